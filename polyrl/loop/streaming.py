"""Streaming rollouts (``RunConfig.streaming``): groups generated continuously, batched
as they finish, staleness checked per sample, weights pushed between chunks.

A background thread of the driver keeps the rollout servers busy with *groups* (one
prompt's ``n`` samples), in rounds: each round sends every unfinished sample's next
request to the servers at once (:meth:`RolloutPool.generate_lossy`). A group is complete
when all its samples are; complete groups wait in a buffer in the order they finished,
and the trainer's :meth:`Stream.take` makes a step's batch of ``prompts_per_step`` of
them as soon as there are that many.

Partial rollouts (``RunConfig.partial_rollout_tokens = K > 0``): a request samples at
most ``K`` tokens; a sample cut there is resumed in the next round from its exact token
ids (prompt + everything sampled so far, a fresh request), so a weight push waits for
one chunk, not for the longest response, and a sample's later chunks may be sampled by
newer weights. Every token keeps the version that sampled it (batch column
``rollout_token_versions``, -1 on padding); ``rollout_weight_version`` is a row's oldest.
This is "abort and resume from tokens" on any engine: a server never sees its weights
change under a request. (``K = 0``: whole requests, a push waits for the round.)

Bounded staleness, by admission and by a check. Admission (AReaL's rule): a new group
starts only while ``started - discarded < (v + N + 1) * P`` (``v`` the servers' weight
version, ``N = max_staleness``, ``P = prompts_per_step``, ``discarded`` the groups that
will never be trained: dropped stale, filtered, lost), and never beyond the run's
``total_steps * P``. Groups finish out of order, so a long one can still be consumed
later than its admission assumed: each batch is checked per sample (staleness = trainer
version - the row's oldest token version; ``async_rollout.staleness_metrics``) and rows
over ``N`` are dropped with their group or kept for the off-policy correction
(``RunConfig.stale_policy``), counted. With ``"drop"`` a group in flight that can no
longer make the bound (``v - its oldest version > N``) is aborted at once (counted).

Dynamic sampling (DAPO): ``accept`` scores a set of complete groups and says which rows
to keep; the stream takes groups until ``P`` are kept (at most ``max_gen_batches * P``
looked at), and the groups filtered out are replaced by admission, as refills are.

Multi-turn episodes (``RunConfig.episodes``, ``episodes=`` an ``EpisodeRunner``): every
sample is an episode that plays its own turns (each on its own server, then its env's
step) as a task of one event loop in the generator's thread, as the episode loop does; a
group starts its episodes (resets their envs) once admitted and is complete when all of
them have ended. A push waits only for the turns being sampled: no new turn's request
starts meanwhile, an env step in flight goes on, so an episode's turns may be sampled by
several versions (per token in the batch, -1 on the observations). A turn whose server
fails is retried on another (``RolloutPool.generate_on``): nothing is lost. With
``stale_policy="drop"`` a stale group still in flight plays on and is dropped at ``take``.

A server that dies mid-round loses only the samples it held: their groups are
discarded (``async/lost_groups``) and the server is re-synced before the next round.

``N = 0`` with ``K = 0`` samples exactly the synchronous loop's batches: group ``g`` is
row ``g % P`` of data batch ``g // P``, seeded as ``RLTrainer.collect`` seeds it, split
over the servers as ``RolloutPool.generate`` splits it, and admitted only once the
servers hold the step's weights.

Resume: the stream restarts at data batch ``step``; groups in flight or buffered at the
checkpoint are generated again (nothing of the stream is saved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.batch import Batch
from polyrl.loop.async_rollout import staleness_metrics
from polyrl.loop.producer import Producer

__all__ = ["Stream", "CHUNK_SEED_STRIDE"]

# Chunk c > 0 of sample s is seeded as sample s + c * CHUNK_SEED_STRIDE (fresh noise).
CHUNK_SEED_STRIDE = 1 << 20


@dataclasses.dataclass
class _Sample:
    index: int  # the sample's row in its data batch's repeated batch (its seed)
    ids: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[np.ndarray] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    texts: list[str | None] = dataclasses.field(default_factory=list)
    finish: str | None = None
    chunks: int = 0

    def result(self, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
        """The sample as ``RolloutServer.generate`` returns one (version: the oldest)."""
        text = self.texts[0] if len(self.texts) == 1 else None
        if len(self.texts) > 1 and self.texts[0] is not None and decode is not None:
            text = decode(self.ids)  # decoded whole: a chunk may end inside a character
        return {
            "token_ids": np.asarray(self.ids, np.int32),
            "log_probs": np.concatenate(self.log_probs).astype(np.float32)
            if self.log_probs
            else np.zeros(0, np.float32),
            "finish_reason": self.finish,
            "text": text,
            "version": min(self.versions, default=-1),
        }


@dataclasses.dataclass
class _Group:
    number: int  # admission order
    data_batch: int
    row: Batch  # the prompt's row (its prompt_ids after the overlong policy)
    start_version: int
    samples: list[Any]  # _Sample, or Episode (multi-turn; none until the stream starts them)
    row_index: int = 0  # the prompt's row in its data batch
    playing: int = 0  # its episodes' turn loops still running (each closes its episode out)

    @property
    def done(self) -> bool:
        return (
            bool(self.samples)
            and not self.playing
            and all(s.finish is not None for s in self.samples)
        )

    @property
    def oldest(self) -> int:
        """The oldest policy version of its sampled tokens (its staleness counts from it;
        an episode's observation tokens carry -1)."""
        sampled = [[v for v in s.versions if v >= 0] for s in self.samples]
        return min((min(v) for v in sampled if v), default=self.start_version)


class Stream(Producer):
    """The batch of each step, from a stream of groups (module docstring): a
    :class:`Producer` whose unit of work is a round of requests (or a wave of episode
    turns), whose pushes wait for one round at most.

    pool: the :class:`RolloutPool`. source(b): data batch ``b``'s prompt rows.
    sampling(b): the :class:`SamplingSpec` of data batch ``b`` (its seed).
    accept(batch) -> (batch, keep): scores complete groups, ``keep`` a row mask (DAPO);
    None keeps every group. decode(ids): the response text of a chunked sample.
    """

    STATS = (
        *("generate_s", "rounds", "gen_idle_s", "wait_s", "pushed_ahead", "push_ahead_s"),
        *("lost_groups", "aborted_stale", "pushed_in_flight"),
    )
    thread_name = "polyrl-stream"

    def __init__(
        self,
        pool: Any,
        source: Callable[[int], Batch],
        sampling: Callable[[int], Any],
        prompts_per_step: int,
        total_steps: int,
        max_staleness: int,
        stale_policy: str = "drop",
        chunk_tokens: int = 0,
        response_len: int | None = None,
        accept: Callable[[Batch], tuple[Batch, np.ndarray]] | None = None,
        max_gen_batches: int = 1,
        decode: Callable[[list[int]], str] | None = None,
        on_span: Callable[[str, float, float, int], None] | None = None,
        phase: Callable[[str], Any] = lambda name: contextlib.nullcontext(),
        episodes: Any = None,
    ):
        self.pool, self.source, self.sampling = pool, source, sampling
        self.episodes = episodes  # an EpisodeRunner: every sample a multi-turn episode
        self.per_step, self.total_steps = prompts_per_step, total_steps
        self.limit, self.stale_policy, self.chunk = max_staleness, stale_policy, chunk_tokens
        self.response_len, self.accept, self.max_gen_batches = response_len, accept, max_gen_batches
        self.decode = decode
        super().__init__(max_staleness, on_span, phase)
        self._loop: Any = None  # episode mode: the event loop of the episodes' turns
        self.load(None, 0)

    @property
    def in_place(self) -> bool:
        """``RolloutConfig.continue_in_place``: a push pauses the round in flight."""
        return bool(self.pool.config.continue_in_place)

    # ------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """``prompts_per_step`` complete groups (in the order they finished) after the
        staleness check (and ``accept``), with ``rollout/`` staleness metrics,
        ``rollout/multi_version_rows`` and ``async/buffer_groups`` (complete groups
        waiting when the trainer asked)."""
        n, want = self._n, self.per_step
        budget = self.max_gen_batches * want  # groups ``accept`` may look at
        with self.phase("generate"):
            with self._cond:
                self._start()
                extra = {"async/buffer_groups": float(len(self._buffer))}
            kept: list[_Group] = []
            parts: list[Batch] = []  # accept's scored rows of the groups kept
            last: tuple[list[_Group], Batch] | None = None
            stale_rows = dropped = seen = 0
            while len(kept) < want:
                room = budget - seen if self.accept is not None else want
                if room <= 0 and (kept or last is not None):
                    break
                groups = self._pop(max(1, min(want - len(kept), room)))
                popped = len(groups)
                seen += popped
                stale = [g for g in groups if step - g.oldest > self.limit]
                stale_rows += n * len(stale)
                if self.stale_policy == "drop":
                    groups = [g for g in groups if g not in stale]
                    dropped += n * len(stale)
                if groups and self.accept is not None:
                    batch, keep = self.accept(self._assemble(groups))
                    last = (groups, batch)
                    keep = np.asarray(keep, bool).reshape(len(groups), n).any(-1)
                    parts.append(batch.take(np.flatnonzero(np.repeat(keep, n))))
                    groups = [g for g, k in zip(groups, keep) if k]
                self._discard(popped - len(groups))
                kept += groups
        informative = len(kept)
        if not kept and last is not None:  # nothing informative: the last groups, all-0
            kept, parts = last[0], [last[1]]  # advantages; trained after all
            self._discard(-len(kept))
        batch = self._merge(kept, parts)
        _, m = staleness_metrics(batch, step, self.limit, "reweight")
        m["rollout/stale_rows"], m["rollout/stale_dropped"] = float(stale_rows), float(dropped)
        if self.accept is not None:
            m["dynamic_sampling/kept_fraction"] = informative / max(seen, 1)
        return batch.with_columns(step=step), m | extra | multi_version_metrics(batch)

    def _merge(self, groups: list[_Group], parts: list[Batch]) -> Batch:
        """The step's batch of ``groups``; with ``accept``, its columns from ``parts`` (the
        scored rows, in the same order). One part is taken as it is (its rows and group
        ids as scored); several are assembled again to one prompt width."""
        if len(parts) == 1:
            return parts[0]
        batch = self._assemble(groups)
        if not parts:
            return batch
        scored = Batch.concat(parts)
        return batch.with_columns(
            {k: scored[k] for k in scored.tensors if k not in batch},
            {k: scored[k] for k in scored.meta if k not in batch},  # e.g. the judge's replies
        )

    def _pop(self, count: int) -> list[_Group]:
        """The ``count`` first complete groups, waiting for them (the wait is
        ``async/wait_s``)."""
        with self._cond:
            self._wait(lambda: len(self._buffer) >= count)
            if self._error is not None:
                raise self._error
            got, self._buffer = self._buffer[:count], self._buffer[count:]
            return got

    def _discard(self, count: int) -> None:
        """``count`` groups will never be trained: admission may replace them."""
        if count:
            with self._cond:
                self._discarded += count
                self._notify()

    def _gauges(self) -> dict[str, float]:
        """``async/in_flight``: samples in flight now (besides the stats: ``rounds``,
        ``lost_groups`` / ``aborted_stale``: groups a dead server lost / aborted for
        staleness, ``pushed_in_flight``: pushes that paused a round in flight,
        ``continue_in_place``)."""
        return {"async/in_flight": float(sum(len(g.samples) for g in self._active))}

    # ------------------------------------------------------------ the generator
    def _produce(self) -> None:
        if self.episodes is not None:
            self._run_episodes()
            return
        while self._next_unit():
            self._round()

    # ---------------------------------------------------- multi-turn episodes
    def _run_episodes(self) -> None:
        """Episode mode: every episode a task of one event loop that lives as long as
        the stream, playing its own turns; a *wave* (the unit) runs the loop until a push
        waits (the trainer's, or a handed copy) and no turn's request is in flight (the
        tasks then wait, an env step in flight goes on), so a push lands between two
        turns of an episode without waiting for the others' turns."""
        import asyncio

        loop = asyncio.new_event_loop()
        with self._cond:
            self._loop, self._changed = loop, asyncio.Event()
        try:
            while self._next_unit():
                loop.run_until_complete(self._wave())
        finally:
            with self._cond:
                self._loop = None
            for task in self._tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            loop.close()

    def _notify(self) -> None:
        """(lock held) Wake the trainer and the generator, and the episodes' loop."""
        super()._notify()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        """(in the episodes' loop) Something changed: wake every coroutine waiting."""
        import asyncio

        self._changed.set()
        self._changed = asyncio.Event()

    async def _wave(self) -> None:
        """Start the admitted groups' episodes, batch the groups whose episodes have all
        ended, admit more as the bound allows; until a push waits with no request in
        flight, the stream stops, or nothing is left to play. Between two passes it
        waits for a change: an episode ended or a turn was sampled, or the trainer
        (a push, a copy handed over, groups discarded, the stream stopped)."""
        import asyncio

        t0, runner = time.perf_counter(), self.episodes
        while True:
            changed = self._changed  # set by any change from here on
            for task in [t for t in self._tasks if t.done()]:
                self._tasks.discard(task)
                task.result()  # an episode's error ends the stream: take() raises it
            with self._cond:
                if not self._held():
                    self._admit_groups()
                fresh = [g for g in self._active if not g.samples]
                ended = [g for g in self._active if g.done]
            for g in fresh:  # its envs reset (agents' episodes played) off the loop
                spec = self.sampling(g.data_batch)
                g.samples = await asyncio.to_thread(runner.start, g.row, spec, g.row_index)
                for e in g.samples:
                    if e.finish is None:
                        task = asyncio.ensure_future(self._play(e, spec))
                        g.playing += 1
                        task.add_done_callback(functools.partial(self._played, g))
                        self._tasks.add(task)
            for g in ended:
                await asyncio.to_thread(runner.finish, g.samples)
            with self._cond:
                for g in ended:
                    self._active.remove(g)
                    self._buffer.append(g)
                if ended:
                    self._cond.notify_all()
                pause = self._holding and not self._requests_in_flight
                if self._stop or pause or not (self._active or self._tasks):
                    break
            if not (fresh or ended):  # (else: look again, a group may have ended at once)
                await changed.wait()
        with self._cond:
            self._finish_unit(t0)

    def _played(self, g: _Group, _task: Any) -> None:
        g.playing -= 1
        self._tick()

    @property
    def _holding(self) -> bool:
        """A push waits: the trainer's, or a copy handed to the generator."""
        return self._held() or self._snapshot is not None

    async def _play(self, e: Any, spec: Any) -> None:
        """One episode's turns; each turn's request waits while a push does (the env
        step after it does not hold the push up)."""
        runner = self.episodes
        for turn in range(runner.config.max_turns):
            if e.finish is not None:
                break
            while True:
                changed = self._changed
                if not self._holding:
                    break
                await changed.wait()
            self._requests_in_flight += 1
            try:
                sampled = await runner.sample_turn(e, turn, spec)
            finally:
                self._requests_in_flight -= 1
                self._tick()  # (the wave pauses once no request is in flight)
            await runner.step_env(e, turn, sampled)
        await runner.ended(e)

    def _admit(self) -> bool:
        """(lock held) A round may start: stale groups aborted, new ones admitted."""
        self._abort_stale()
        self._admit_groups()
        return bool(self._active)

    def _admit_groups(self) -> None:
        """Start groups while the bound allows (module docstring)."""
        quota = min(self._version + self.limit + 1, self.total_steps) * self.per_step
        while self._started - self._discarded < quota:
            if not self._rows:  # the next data batch, after the overlong-prompt policy
                from polyrl.rollout.pool import PROMPT_KEY, apply_overlong_policy

                prompts = self.source(self._cursor)
                kept, ids = apply_overlong_policy(
                    prompts[PROMPT_KEY],
                    self.pool.config.prompt_limit,
                    self.pool.config.overlong_prompt,
                )
                rows = prompts.take(kept).with_columns(meta={PROMPT_KEY: ids})
                self._rows = [(self._cursor, i, rows.take([j])) for j, i in enumerate(kept)]
                self._cursor += 1
                continue
            data_batch, i, row = self._rows.pop(0)
            # an episode group's episodes start (their envs reset) in the stream's loop
            samples = [] if self.episodes else [_Sample(i * self._n + j) for j in range(self._n)]
            group = _Group(self._started, data_batch, row, self._version, samples, i)
            self._active.append(group)
            self._started += 1

    def _abort_stale(self) -> None:
        """With ``stale_policy="drop"``: groups in flight that can no longer make the bound."""
        if self.stale_policy != "drop" or self.episodes is not None:
            return  # (episode groups in flight play on; take() drops them if stale)
        late = [g for g in self._active if self._version - g.oldest > self.limit]
        if late:
            self._active = [g for g in self._active if g not in late]
            self._stats["aborted_stale"] += len(late)
            self._discarded += len(late)

    def _round(self) -> None:
        """One request per unfinished sample of every active group."""
        t0 = time.perf_counter()
        with self._cond:
            groups = list(self._active)
        lost = self._requests(groups)
        with self._cond:
            for g in groups:
                if id(g) in lost:
                    self._active.remove(g)
                    self._stats["lost_groups"] += 1
                    self._discarded += 1
                elif g.done:
                    self._active.remove(g)
                    self._buffer.append(g)
            self._finish_unit(t0)

    def _requests(self, groups: list[_Group]) -> set[int]:
        """One request per unfinished sample of ``groups`` (one ``generate_lossy`` call per
        data batch, all submitted at once). Returns the groups (``id``) a dead server lost."""
        calls: dict[int, tuple[list[tuple], Any, list[_Sample]]] = {}
        for g in groups:
            spec = self.sampling(g.data_batch)
            requests, spec, owners = calls.setdefault(g.data_batch, ([], spec, []))
            prompt = list(g.row["prompt_ids"][0])
            for s in g.samples:
                if s.finish is None:
                    left = spec.max_tokens - len(s.ids)
                    cap = min(self.chunk, left) if self.chunk else left
                    requests.append((s.index + s.chunks * CHUNK_SEED_STRIDE, prompt + s.ids, cap))
                    owners.append(s)
        results, _ = self.pool.generate_lossy([(r, spec) for r, spec, _ in calls.values()])
        lost: set[int] = set()
        for (_, spec, owners), got in zip(calls.values(), results):
            for s, r in zip(owners, got):
                if r is None:  # its server died: the group is lost
                    lost.add(id(s))
                    continue
                s.ids += np.asarray(r["token_ids"]).tolist()
                s.log_probs.append(np.asarray(r["log_probs"], np.float32))
                versions = r.get("token_versions")  # continue_in_place: per token
                if versions is None:
                    versions = [int(r["version"])] * len(r["token_ids"])
                s.versions += list(map(int, versions))
                s.texts.append(r["text"])
                s.chunks += 1
                if r["finish_reason"] != "length" or len(s.ids) >= spec.max_tokens:
                    s.finish = r["finish_reason"]
        return {id(g) for g in groups if any(id(s) in lost for s in g.samples)}

    # ------------------------------------------------------------ the batch
    @property
    def _n(self) -> int:
        return int(self.sampling(0).n)

    def _assemble(self, groups: list[_Group]) -> Batch:
        """The groups as one batch in the layout of ``RolloutPool.generate``, plus
        ``rollout_token_versions`` [N, R] int32 (-1 on padding)."""
        spec = self.sampling(groups[0].data_batch)
        rep = Batch.concat([g.row for g in groups]).repeat(self._n)
        if self.episodes is not None:  # its token versions too (-1 on observations)
            return self.episodes.assemble(rep, [e for g in groups for e in g.samples], spec)
        results = [s.result(self.decode) for g in groups for s in g.samples]
        batch = self.pool.assemble(rep, results, spec, [], None, self.response_len)
        versions = np.full(batch["responses"].shape, -1, np.int32)
        for row, s in enumerate(s for g in groups for s in g.samples):
            versions[row, : len(s.versions)] = s.versions
        return batch.with_columns({"rollout_token_versions": versions})

    # ------------------------------------------------------------ lifetime
    def discard(self) -> None:
        """Stop the generator (a round in flight finishes in its daemon thread)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def load(self, path: Path | None, step: int) -> None:
        """Start (again) at data batch ``step`` with the servers at weight version
        ``step`` (nothing of the stream is saved: module docstring, "Resume")."""
        self.discard()
        with self._cond:
            self._thread, self._stop, self._error = None, False, None
            self._version, self._cursor = step, step
            self._started, self._discarded = step * self.per_step, 0
            self._rows: list[tuple[int, int, Batch]] = []
            self._active: list[_Group] = []
            self._buffer: list[_Group] = []
            self._busy = self._waiting = self._hold = False
            self._tasks: set[Any] = set()  # episode mode: one asyncio task per episode
            self._requests_in_flight = 0  # episode mode: turns being sampled
            self._snapshot = None
            self._stats = dict.fromkeys(self.STATS, 0.0)


def multi_version_metrics(batch: Batch) -> dict[str, float]:
    """``rollout/multi_version_rows``: rows whose sampled tokens carry two or more policy
    versions (a partial rollout across a weight push), from ``rollout_token_versions``."""
    if "rollout_token_versions" not in batch:
        return {"rollout/multi_version_rows": 0.0}
    v = np.asarray(batch["rollout_token_versions"], np.int64)
    sampled = v >= 0
    high = np.where(sampled, v, np.iinfo(np.int64).min).max(-1)
    low = np.where(sampled, v, np.iinfo(np.int64).max).min(-1)
    return {"rollout/multi_version_rows": float((sampled.any(-1) & (high > low)).sum())}
