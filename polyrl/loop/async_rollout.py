"""Where a step's rollouts come from: generated in the step, or up to N versions ahead.

``RunConfig.max_staleness = N`` bounds how many policy versions older than the trainer's
the policy that sampled a batch may be (AReaL's ``max_head_offpolicyness``).

``N = 0`` (the default): synchronous. Step ``k`` generates its batch, trains on it, then
pushes weight version ``k + 1`` to the rollout servers: every sample is on-policy.

``N >= 1``: a background thread generates batches ``0, 1, 2, ...`` in order, one
``collect`` call at a time, and keeps them until the trainer takes them. It starts batch
``j`` only once the servers hold weight version ``>= j - N``, so batch ``j``, trained at
step ``j`` by weight version ``j``, is at most ``N`` versions stale; the same rule keeps at
most ``N + 1`` batches generated ahead. The weights never change under a running generate:
the trainer's weight push (:meth:`Rollouts.sync`) waits until the generator is between
batches. With ``N >= 2`` the trainer instead hands a busy generator a host copy of the
weights (``RLTrainer.weights_snapshot``) that the generator's thread pushes before its
next batch, so the trainer does not wait to push. A batch the generator may start under the servers' version is always sampled by
it (a push waits for it even if its thread has not woken yet). With ``N = 1`` this is
exactly verl's one-step-off-policy trainer (batch ``k + 1`` is sampled by version ``k``
while the actor trains on batch ``k``; the push waits for it), the former
``RunConfig.async_rollout = True``. Each row's staleness is ``step -
rollout_weight_version`` (the column ``RolloutPool.generate`` fills); rows beyond ``N``
(only possible for batches read back from a checkpoint written with a larger ``N``) are
dropped, whole groups at a time, or kept for the off-policy correction to re-weight
(``RunConfig.stale_policy``), and counted. The trainer's ``old_log_probs`` are recomputed
with the current weights, so the PPO ratio stays on-policy; the rollout/trainer mismatch
is what the off-policy corrections in ``polyrl.algos.losses`` handle (``tis_cap``,
``is_mask_low`` / ``is_mask_high``).

Determinism: batch ``k`` is always the data batch ``k`` with the sampling noise seeded by
``k`` (``RLTrainer.collect``); with ``N <= 1`` the weights that sample it are fixed too
(version ``k - N``); with ``N >= 2`` they depend on timing (any version in ``k - N .. k``).
Resume: every batch generated ahead and finished is written into each checkpoint
(:func:`save_batch`: ``.npz`` for arrays, JSON for the rest, nothing pickled) and read back
by ``--resume``; one still generating is regenerated with the restored weights. With
``N <= 1`` a resumed run takes the same steps as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.batch import Batch

__all__ = [
    "STALE_POLICIES",
    "Rollouts",
    "async_problems",
    "load_batch",
    "mismatch_metrics",
    "save_batch",
    "staleness_bound",
    "staleness_metrics",
    "streaming_problems",
]

PENDING = "pending_batch"  # file stem of a batch generated ahead, inside a checkpoint
# RunConfig.stale_policy: what happens to rows older than max_staleness
STALE_POLICIES = ("drop", "reweight")


def staleness_metrics(
    batch: Batch, version: int, limit: int, policy: str = "drop"
) -> tuple[Batch, dict[str, float]]:
    """Apply the staleness bound to ``batch``, trained by weight version ``version``: each
    row's staleness is ``version - rollout_weight_version``. Rows above ``limit`` are
    dropped with their whole group (``group_ids``; ``policy="drop"``) or kept for the
    off-policy correction (``"reweight"``). Metrics: ``rollout/staleness_mean`` / ``_max``
    (of the rows kept), ``rollout/stale_rows`` (rows above the bound) and
    ``rollout/stale_dropped`` (rows dropped). RuntimeError for a negative staleness."""
    staleness = version - np.asarray(batch["rollout_weight_version"], dtype=np.int64)
    if staleness.size and staleness.min() < 0:
        raise RuntimeError(
            f"rollout staleness {staleness.min()}..{staleness.max()} at trainer weight version "
            f"{version} is negative: the rollout servers hold weights the trainer did not push "
            f"(a server restarted without a re-sync?)"
        )
    stale = staleness > limit
    dropped = 0
    if stale.any() and policy == "drop":
        keep = ~stale
        if "group_ids" in batch:  # a group is complete only with all its samples
            ids = np.asarray(batch["group_ids"])
            keep = ~np.isin(ids, ids[stale])
        dropped = int((~keep).sum())
        batch, staleness = batch.take(np.flatnonzero(keep)), staleness[keep]
    return batch, {
        "rollout/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
        "rollout/staleness_max": float(staleness.max()) if staleness.size else 0.0,
        "rollout/stale_rows": float(stale.sum()),
        "rollout/stale_dropped": float(dropped),
    }


def mismatch_metrics(batch: Batch) -> dict[str, float]:
    """How far the rollout's log-probs of the sampled tokens are from the trainer's
    (``old_log_probs``), over response tokens: ``rollout/log_prob_diff_mean`` and ``_max``
    of ``|old_log_probs - rollout_log_probs|``. Near 0 when the servers hold the trainer's
    weights (kernel noise only); staleness and precision raise it (TIS corrects it)."""
    mask = np.asarray(batch["response_mask"]) > 0
    diff = np.abs(np.asarray(batch["old_log_probs"]) - np.asarray(batch["rollout_log_probs"]))[mask]
    return {
        "rollout/log_prob_diff_mean": float(diff.mean()) if diff.size else 0.0,
        "rollout/log_prob_diff_max": float(diff.max()) if diff.size else 0.0,
    }


class Rollouts:
    """The batch of each step. ``collect(step) -> Batch`` generates a step's batch (the
    trainer's). ``max_staleness = 0``: :meth:`take` calls it in the caller's thread.
    Otherwise a background thread generates ahead under the bound (module docstring);
    :meth:`take` waits for the step's batch and :meth:`sync` pushes new weights between
    two generations. Batches beyond ``total_steps`` are never generated."""

    def __init__(
        self,
        collect: Callable[[int], Batch],
        total_steps: int,
        max_staleness: int,
        stale_policy: str = "drop",
        on_span: Callable[[str, float, float, int], None] | None = None,
        phase: Callable[[str], Any] = lambda name: contextlib.nullcontext(),
    ):
        self.collect, self.total_steps, self.on_span = collect, total_steps, on_span
        self.phase = phase  # times the trainer's waits ("generate") and pushes
        self.limit, self.stale_policy = max_staleness, stale_policy
        self._cond = threading.Condition()
        self._ready: dict[int, Batch | BaseException] = {}
        self._version = 0  # the weight version the rollout servers hold
        self._next = 0  # the next batch the generator starts
        self._taken = 0  # the trainer has taken every batch before this one
        self._busy = self._pushing = self._stop = False
        self._snapshot: tuple[Callable[[], dict[str, float]], int] | None = None
        self._thread: threading.Thread | None = None
        self._alive = False  # the generator's thread runs (it stops after a failure)
        self._stats = dict.fromkeys(
            ("generate_s", "generated", "gen_idle_s", "wait_s", "pushed_ahead"), 0.0
        )
        self._spans: list[tuple[float, float, int]] = []  # (start, seconds, batch) generated

    # ------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Batch ``step`` (generated ahead, or now) after the staleness bound, and its
        staleness metrics (:func:`staleness_metrics`) plus ``async/buffer_batches``: how
        many batches were ready when the trainer asked (this one included)."""
        extra: dict[str, float] = {}
        with self.phase("generate"):
            if self.limit == 0:
                got: Batch | BaseException = self.collect(step)
            else:
                with self._cond:
                    if self._thread is None:
                        self._next = max(self._next, step)
                        self._thread = threading.Thread(
                            target=self._generate, name="polyrl-rollout-ahead", daemon=True
                        )
                        self._alive = True
                        self._thread.start()
                    extra["async/buffer_batches"] = float(len(self._ready))
                    t0 = time.perf_counter()
                    while step not in self._ready:
                        self._cond.wait()
                    self._stats["wait_s"] += time.perf_counter() - t0
                    got = self._ready.pop(step)
                    self._taken = step + 1
        if isinstance(got, BaseException):
            raise got
        batch, metrics = staleness_metrics(got, step, self.limit, self.stale_policy)
        if len(batch) == 0:  # all stale and dropped: sample it again, now (within the bound)
            with self.exclusive():
                batch, again = staleness_metrics(self.collect(step), step, self.limit)
            metrics |= {k: v for k, v in again.items() if k.startswith("rollout/staleness")}
        return batch, metrics | extra

    def sync(
        self,
        push: Callable[[], dict[str, float]],
        version: int,
        required: bool = False,
        snapshot: Callable[[], Callable[[], dict[str, float]]] | None = None,
    ) -> dict[str, float]:
        """Push weight ``version`` to the servers with ``push()`` once no generation runs
        (nor one the generator may start under the servers' version). With ``snapshot``
        (``snapshot()`` copies the weights now and returns a push of that copy) a busy
        generator does not make the trainer wait: the copy is taken (phase
        "snapshot_weights"; metric ``async/sync_deferred`` = 1) and the generator's thread
        pushes it before its next batch (``async/pushed_ahead``); ``required`` (e.g. before
        a validation) pushes now regardless. Returns ``push``'s metrics and the
        ``async/`` metrics since the last call: ``generate_s`` (background generation wall time), ``generated`` (batches),
        ``gen_idle_s`` (the generator waited for the bound or a push), ``wait_s`` (the
        trainer waited for generation: for its batch or to push)."""
        if self.limit == 0:
            with self.phase("sync_weights"):
                return push()
        with self._cond:
            self._snapshot = None
            # A batch the generator may start under the servers' version is sampled by
            # it (if its thread has not woken yet, the push waits for it too): with N = 1
            # batch k + 1 is always sampled by version k, whatever the timing.
            if (self._busy or self._startable()) and not required and snapshot is not None:
                with self.phase("snapshot_weights"):
                    self._snapshot = (snapshot(), version)
                return {"async/sync_deferred": 1.0} | self._report()
            with self.phase("generate"):
                t0 = time.perf_counter()
                while self._busy or self._pushing or self._startable():
                    self._cond.wait()
                self._stats["wait_s"] += time.perf_counter() - t0
            return self._push(push, version) | {"async/sync_deferred": 0.0} | self._report()

    def _startable(self) -> bool:
        """The generator may start a batch now (it will, once its thread runs)."""
        index = self._next
        while index in self._ready or index < self._taken:
            index += 1
        return (
            self._alive
            and not self._pushing
            and index < self.total_steps
            and index - self.limit <= self._version
        )

    def _push(self, push: Callable[[], dict[str, float]], version: int) -> dict[str, float]:
        """Run ``push`` (called with the lock held and no generation running; the lock is
        released meanwhile, and the generator starts nothing until it is done)."""
        self._pushing = True
        self._cond.release()
        try:
            with self.phase("sync_weights"):
                return push()
        finally:
            self._cond.acquire()
            self._pushing = False
            self._version = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No background generation runs while the body does (e.g. a refill generated
        by the trainer's thread, or a weight push)."""
        if self.limit == 0:
            yield
            return
        with self._cond:
            while self._busy or self._pushing:
                self._cond.wait()
            self._pushing = True
        try:
            yield
        finally:
            with self._cond:
                self._pushing = False
                self._cond.notify_all()

    def _report(self) -> dict[str, float]:
        """The ``async/`` metrics since the last call; the background generations as
        ``generate_ahead`` spans to ``on_span`` (the timeline; step = batch + 1, as the
        trainer's steps count there), from the trainer's thread."""
        with self._cond:  # (re-entrant)
            out = {f"async/{k}": v for k, v in self._stats.items()}
            self._stats = dict.fromkeys(self._stats, 0.0)
            spans, self._spans = self._spans, []
        for start, seconds, index in spans if self.on_span else ():
            self.on_span("generate_ahead", start, seconds, index + 1)
        return out

    # ------------------------------------------------------------ the generator
    def _generate(self) -> None:
        try:
            self._generate_batches()
        finally:
            with self._cond:
                self._alive = False
                self._cond.notify_all()

    def _generate_batches(self) -> None:
        while True:
            with self._cond:
                t0 = time.perf_counter()
                while self._next in self._ready or self._next < self._taken:
                    self._next += 1  # read back from a checkpoint (and maybe taken already)
                while (
                    not self._stop
                    and self._next < self.total_steps
                    and (
                        self._pushing
                        or (self._next - self.limit > self._version and self._snapshot is None)
                    )
                ):
                    self._cond.wait()
                self._stats["gen_idle_s"] += time.perf_counter() - t0
                if self._stop or self._next >= self.total_steps:
                    return
                if self._snapshot is not None:  # the trainer's copy: push it, then go on
                    (push, version), self._snapshot = self._snapshot, None
                    self._pushing = True
                    self._cond.release()
                    try:
                        push()
                    except BaseException as e:  # re-raised by take() in the trainer
                        failed: BaseException | None = e
                    else:
                        failed = None
                    self._cond.acquire()
                    self._pushing = False
                    self._cond.notify_all()
                    if failed is not None:
                        self._ready[self._next] = failed
                        return
                    self._version = version
                    self._stats["pushed_ahead"] += 1
                    continue
                index, self._busy = self._next, True
            t0 = time.perf_counter()
            try:
                got: Batch | BaseException = self.collect(index)
            except BaseException as e:  # re-raised by take() in the trainer
                got = e
            with self._cond:
                self._spans.append((t0, time.perf_counter() - t0, index))
                self._stats["generate_s"] += time.perf_counter() - t0
                self._stats["generated"] += 1
                self._busy, self._next = False, index + 1
                if not self._stop:
                    self._ready[index] = got
                self._cond.notify_all()
                if isinstance(got, BaseException):
                    return

    def discard(self) -> None:
        """Stop generating ahead and forget the batches generated (a generation in flight
        finishes on its own, in its daemon thread)."""
        with self._cond:
            self._stop, self._alive = True, False
            self._ready.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Write every batch generated ahead and finished into checkpoint dir ``path``."""
        with self._cond:
            ready = {i: b for i, b in self._ready.items() if isinstance(b, Batch)}
        for index, batch in sorted(ready.items()):
            save_batch(batch, path / f"{PENDING}_{index}")

    def load(self, path: Path, step: int) -> None:
        """Take the batches generated ahead from checkpoint ``path`` (those for steps
        ``>= step``); the servers hold weight version ``step`` (the trainer re-syncs them
        on resume). Steps without a saved batch generate their own."""
        self.discard()
        with self._cond:
            self._stop, self._version, self._next, self._taken = False, step, step, step
            if self.limit == 0:
                return
            for doc in sorted(path.glob(f"{PENDING}*.json")):
                batch = load_batch(doc.with_suffix(""))
                if batch.info.get("step", -1) >= step:
                    self._ready[int(batch.info["step"])] = batch


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def save_batch(batch: Batch, stem: Path) -> None:
    """``stem.npz`` (numeric columns) + ``stem.json`` (meta columns and info): read back
    by :func:`load_batch` without unpickling anything."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    np.savez(stem.with_suffix(".npz"), **batch.tensors)
    doc = {"meta": {k: list(v) for k, v in batch.meta.items()}, "info": batch.info}
    stem.with_suffix(".json").write_text(json.dumps(doc, default=_jsonable))


def load_batch(stem: Path) -> Batch:
    with np.load(stem.with_suffix(".npz"), allow_pickle=False) as arrays:
        tensors = {k: arrays[k] for k in arrays.files}
    doc = json.loads(stem.with_suffix(".json").read_text())
    return Batch(tensors, doc["meta"], doc["info"])


def staleness_bound(cfg: Any) -> int:
    """``RunConfig.max_staleness``; the older ``RunConfig.async_rollout = True`` still
    means one version ahead (the same as ``max_staleness = 1``)."""
    return max(int(cfg.max_staleness), int(bool(getattr(cfg, "async_rollout", False))))


def async_problems(cfg: Any, spec: Any) -> list[str]:
    """Configuration problems of ``RunConfig.max_staleness`` / ``stale_policy``
    (``polyrl.configure.validate``)."""
    problems = []
    if not isinstance(cfg.max_staleness, int) or cfg.max_staleness < 0:
        problems.append(
            f"RunConfig.max_staleness={cfg.max_staleness!r} must be an integer >= 0 (policy "
            f"versions a sample may lag the trainer: 0 synchronous, 1 one step ahead, ...)"
        )
    if cfg.stale_policy not in STALE_POLICIES:
        problems.append(
            f"RunConfig.stale_policy={cfg.stale_policy!r}: valid choices {list(STALE_POLICIES)}"
        )
    corrected = getattr(spec, "tis_cap", None) is not None or (
        getattr(spec, "is_mask_low", None) is not None
        or getattr(spec, "is_mask_high", None) is not None
    )
    if cfg.stale_policy == "reweight" and spec.objective == "rl" and not corrected:
        problems.append(
            "RunConfig.stale_policy='reweight' keeps samples older than max_staleness for the "
            "off-policy correction to re-weight, but none is on: set RunConfig.algo_overrides "
            "tis_cap (e.g. 2.0) or is_mask_low / is_mask_high, or stale_policy='drop'"
        )
    problems += streaming_problems(cfg, spec)
    if problems or not staleness_bound(cfg):
        return problems
    setting = (
        f"RunConfig.max_staleness={cfg.max_staleness}"
        if cfg.max_staleness
        else "RunConfig.async_rollout=True"
    )
    setting += " with RunConfig.streaming=True" if cfg.streaming else ""
    if spec.objective != "rl":
        return [
            f"{setting}: algorithm {spec.name!r} ({spec.objective}) has no rollouts to "
            f"generate ahead; set RunConfig.max_staleness=0"
        ]
    pool = cfg.actor.pool
    shares_gpu = pool == cfg.rollout.pool and float(cfg.pools.get(pool, {}).get("GPU", 0))
    if cfg.offload_colocated or (cfg.offload_colocated is None and shares_gpu):
        return [
            f"{setting} generates while the actor trains, but the actor and rollout take "
            f"turns on the GPUs of pool {pool!r} (RunConfig.offload_colocated="
            f"{cfg.offload_colocated}); give the rollout its own pool (polyrl.RolloutConfig.pool) "
            f"(e.g. rollout on GPU 1, actor on GPU 0) or set RunConfig.offload_colocated=False"
        ]
    return []


def streaming_problems(cfg: Any, spec: Any) -> list[str]:
    """Problems of ``RunConfig.streaming`` / ``partial_rollout_tokens`` (``polyrl.loop.streaming``)."""
    chunk = cfg.partial_rollout_tokens
    if not isinstance(chunk, int) or chunk < 0:
        return [
            f"RunConfig.partial_rollout_tokens={chunk!r} must be an integer >= 0 (tokens a "
            f"streaming request samples before it is resumed; 0: whole requests)"
        ]
    if not cfg.streaming:
        if chunk:
            return [
                f"RunConfig.partial_rollout_tokens={chunk} needs RunConfig.streaming=True "
                f"(partial rollouts are resumed by the stream); set both, or 0"
            ]
        if cfg.rollout is not None and cfg.rollout.continue_in_place:
            return [
                "RolloutConfig.continue_in_place=True needs RunConfig.streaming=True (only "
                "the stream pushes weights while requests are in flight); set both, or False"
            ]
        return []
    unsupported = (
        (spec.objective != "rl", f"algorithm {spec.name!r} ({spec.objective}) has no rollouts"),
        (spec.needs_greedy_baseline, "ReMax's greedy baseline is sampled per batch"),
    )
    out = [
        f"RunConfig.streaming=True is not supported here: {why}; set RunConfig.streaming="
        f"False (RunConfig.max_staleness still generates ahead)"
        for bad, why in unsupported
        if bad
    ]
    if cfg.episodes is not None and chunk:
        out.append(
            f"RunConfig.partial_rollout_tokens={chunk} with multi-turn episodes "
            f"(RunConfig.episodes): the stream samples an episode's turns whole (a push lands "
            f"between two turns); set RunConfig.partial_rollout_tokens=0"
        )
    if cfg.rollout is None:  # no rollout role (preference or SFT runs): reported above
        return out
    actor, rollout = cfg.actor.pool, cfg.rollout.pool
    on_gpus = all(float(cfg.pools.get(p, {}).get("GPU", 0)) > 0 for p in (actor, rollout))
    if on_gpus and actor != rollout and cfg.weight_transport != "nccl":
        out.append(
            f"RunConfig.streaming=True with the actor (pool {actor!r}) and the rollout (pool "
            f"{rollout!r}) on separate GPUs needs RunConfig.weight_transport='nccl' (got "
            f"{cfg.weight_transport!r}): every push pauses the stream's rounds, and "
            f"'object_store' carries the weights through host memory"
        )
    return out
