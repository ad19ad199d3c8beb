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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.batch import Batch
from polyrl.loop.producer import Producer

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


class Rollouts(Producer):
    """The batch of each step, as whole batches. ``collect(step) -> Batch`` generates a
    step's batch (the trainer's). ``max_staleness = 0``: :meth:`take` calls it in the
    caller's thread. Otherwise the generator generates ahead under the bound (module
    docstring), one batch a unit; :meth:`take` waits for the step's batch and
    :meth:`sync` pushes new weights between two generations (:class:`Producer`). Batches
    beyond ``total_steps`` are never generated."""

    STATS = ("generate_s", "generated", "gen_idle_s", "wait_s", "pushed_ahead", "push_ahead_s")
    push_first = False  # batch k + 1 under version k - N + 1 starts before the push
    thread_name = "polyrl-rollout-ahead"

    def __init__(
        self,
        collect: Callable[[int], Batch],
        total_steps: int,
        max_staleness: int,
        stale_policy: str = "drop",
        on_span: Callable[[str, float, float, int], None] | None = None,
        phase: Callable[[str], Any] = lambda name: contextlib.nullcontext(),
    ):
        super().__init__(max_staleness, on_span, phase)
        self.collect, self.total_steps, self.stale_policy = collect, total_steps, stale_policy
        self._ready: dict[int, Batch] = {}
        self._next = 0  # the next batch the generator starts
        self._taken = 0  # the trainer has taken every batch before this one

    @property
    def synchronous(self) -> bool:
        return self.limit == 0

    # ------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Batch ``step`` (generated ahead, or now) after the staleness bound, and its
        staleness metrics (:func:`staleness_metrics`) plus ``async/buffer_batches``: how
        many batches were ready when the trainer asked (this one included)."""
        extra: dict[str, float] = {}
        with self.phase("generate"):
            if self.synchronous:
                got: Batch | BaseException = self.collect(step)
            else:
                with self._cond:
                    if self._thread is None:
                        self._next = max(self._next, step)
                    self._start()
                    extra["async/buffer_batches"] = float(len(self._ready))
                    self._wait(lambda: step in self._ready)
                    got = self._ready.pop(step, self._error)
                    self._taken = step + 1
        if isinstance(got, BaseException):
            raise got
        batch, metrics = staleness_metrics(got, step, self.limit, self.stale_policy)
        if len(batch) == 0:  # all stale and dropped: sample it again, now (within the bound)
            with self.exclusive():
                batch, again = staleness_metrics(self.collect(step), step, self.limit)
            metrics |= {k: v for k, v in again.items() if k.startswith("rollout/staleness")}
        return batch, metrics | extra

    # ------------------------------------------------------------ the generator
    def _skip(self) -> int:
        """(lock held) The next batch to generate, past those read back from a
        checkpoint (and maybe taken already)."""
        while self._next in self._ready or self._next < self._taken:
            self._next += 1
        return self._next

    def _done(self) -> bool:
        return self._skip() >= self.total_steps

    def _admit(self) -> bool:
        return self._skip() - self.limit <= self._version

    def _startable(self) -> bool:
        return self._alive and not self._held() and not self._done() and self._admit()

    def _produce(self) -> None:
        while self._next_unit():
            index, t0 = self._next, time.perf_counter()
            batch = self.collect(index)
            with self._cond:
                self._next = index + 1
                if not self._stop:
                    self._ready[index] = batch
                self._finish_unit(t0, index + 1)  # (the timeline counts steps from 1)

    def discard(self) -> None:
        """Stop generating ahead and forget the batches generated (a generation in flight
        finishes on its own, in its daemon thread)."""
        with self._cond:
            self._ready.clear()
            super().discard()

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Write every batch generated ahead and finished into checkpoint dir ``path``."""
        with self._cond:
            ready = dict(self._ready)
        for index, batch in sorted(ready.items()):
            save_batch(batch, path / f"{PENDING}_{index}")

    def load(self, path: Path, step: int) -> None:
        """Take the batches generated ahead from checkpoint ``path`` (those for steps
        ``>= step``); the servers hold weight version ``step`` (the trainer re-syncs them
        on resume). Steps without a saved batch generate their own."""
        self.discard()
        with self._cond:
            self._stop, self._version, self._next, self._taken = False, step, step, step
            if self.synchronous:
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
    from polyrl.weight_sync import stream_transport_problems

    return out + stream_transport_problems(
        cfg.weight_transport, cfg.actor.pool, cfg.rollout.pool, cfg.pools
    )
