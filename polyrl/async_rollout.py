"""Where a step's rollouts come from: generated in the step, or one step ahead.

Synchronous (the default): step ``k`` generates its batch, trains on it, then pushes
weight version ``k + 1`` to the rollout servers, so every sample is on-policy.

Asynchronous, one-step off-policy (``RunConfig.async_rollout = True``; verl's
one-step-off-policy trainer, AReaL's ``max_head_offpolicyness = 1``): as soon as step
``k`` has its batch, generation of batch ``k + 1`` starts in a background thread with
the weights the servers hold (version ``k``) and runs while the actor trains on batch
``k``. Before pushing version ``k + 1`` the trainer waits for that generation, so the
weights never change under a running generate. Batch ``k + 1`` was thus sampled by the
policy of one update earlier: staleness ``1`` for every step but the first. The
staleness of each sample is ``step - rollout_weight_version`` (the column
``RolloutPool.generate`` fills); :func:`staleness_metrics` logs it and refuses anything
above :data:`MAX_STALENESS`. The trainer's ``old_log_probs`` are recomputed with the
current weights, so the PPO ratio stays on-policy; the rollout/trainer mismatch is what
truncated importance sampling corrects (``AlgorithmSpec.tis_cap``).

Determinism: batch ``k`` is always the data batch ``k`` with the sampling noise seeded by
``k`` (``RLTrainer.collect``); only the weights that sample it differ between modes.
Resume: the batch generated ahead is written into each checkpoint
(:func:`save_batch`: ``.npz`` for arrays, JSON for the rest, nothing pickled) and read
back by ``--resume``, so a resumed asynchronous run takes the same steps as an
uninterrupted one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.batch import Batch

__all__ = [
    "MAX_STALENESS",
    "Rollouts",
    "async_problems",
    "load_batch",
    "mismatch_metrics",
    "save_batch",
    "staleness_metrics",
]

# One-step off-policy: a sample may come from the policy one update older, never more.
MAX_STALENESS = 1
PENDING = "pending_batch"  # file stem of the batch generated ahead, inside a checkpoint


def staleness_metrics(batch: Batch, version: int, limit: int) -> dict[str, float]:
    """``rollout/staleness_mean`` / ``_max``: how many updates behind ``version`` (the
    trainer's weight version this step) the policy that sampled each row was, from the
    ``rollout_weight_version`` column. RuntimeError above ``limit``."""
    staleness = version - np.asarray(batch["rollout_weight_version"], dtype=np.int64)
    if staleness.size and (staleness.max() > limit or staleness.min() < 0):
        raise RuntimeError(
            f"rollout staleness {staleness.min()}..{staleness.max()} at trainer weight version "
            f"{version} is outside 0..{limit}: the rollout servers hold weights the trainer "
            f"did not push (a server restarted without a re-sync?)"
        )
    return {
        "rollout/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
        "rollout/staleness_max": float(staleness.max()) if staleness.size else 0.0,
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
    trainer's); with ``ahead`` on, :meth:`take` starts the next step's ``collect`` in a
    background thread before returning, and :meth:`settle` waits for it (call it before
    the weights change). Batches beyond ``total_steps`` are never generated."""

    def __init__(self, collect: Callable[[int], Batch], total_steps: int, ahead: bool):
        self.collect, self.total_steps, self.ahead = collect, total_steps, ahead
        self.limit = MAX_STALENESS if ahead else 0
        self._pending: tuple[int, Future] | None = None
        self._seconds = 0.0  # wall time of the last background generation

    def take(self, step: int) -> Batch:
        """Batch ``step`` (generated ahead, or now), and start generating ``step + 1``."""
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        else:
            self.discard()
            batch = self.collect(step)
        self._pending = None
        if self.ahead and step + 1 < self.total_steps:
            self._pending = (step + 1, self._start(step + 1))
        return batch

    def settle(self) -> dict[str, float]:
        """Wait until the background generation (if any) is done. Metrics: its wall time
        ``async/generate_s`` and ``async/wait_s``, how long this call waited for it (the
        rest ran hidden behind the step's other phases)."""
        if self._pending is None:
            return {}
        t0 = time.perf_counter()
        self._pending[1].result()
        return {"async/generate_s": self._seconds, "async/wait_s": time.perf_counter() - t0}

    def _start(self, step: int) -> Future:
        future: Future = Future()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                batch = self.collect(step)
            except BaseException as e:  # re-raised by future.result() in the trainer
                future.set_exception(e)
                return
            self._seconds = time.perf_counter() - t0
            future.set_result(batch)

        # A daemon thread: a driver that dies mid-generation must not hang on exit.
        threading.Thread(target=run, name=f"polyrl-rollout-{step}", daemon=True).start()
        return future

    def discard(self) -> None:
        """Forget a batch in flight (its thread finishes on its own)."""
        self._pending = None

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Write the batch generated ahead (settled) into checkpoint dir ``path``."""
        if self._pending is not None and self._pending[1].done():
            save_batch(self._pending[1].result(), path / PENDING)

    def load(self, path: Path, step: int) -> None:
        """Take the batch generated ahead from checkpoint ``path`` as batch ``step``
        (none there: step ``step`` generates its own, with the restored weights)."""
        self.discard()
        if self.ahead and (path / f"{PENDING}.json").exists():
            batch = load_batch(path / PENDING)
            if batch.info.get("step") == step:
                future: Future = Future()
                future.set_result(batch)
                self._pending = (step, future)


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


def async_problems(cfg: Any, spec: Any) -> list[str]:
    """Configuration problems of ``RunConfig.async_rollout`` (``polyrl.validate``)."""
    if not getattr(cfg, "async_rollout", False):
        return []
    if spec.objective != "rl":
        return [
            f"RunConfig.async_rollout=True: algorithm {spec.name!r} ({spec.objective}) has no "
            f"rollouts to generate ahead; set RunConfig.async_rollout=False"
        ]
    pool = cfg.role_pools.get("actor")
    shares_gpu = pool == cfg.role_pools.get("rollout") and float(
        cfg.pools.get(pool, {}).get("GPU", 0)
    )
    if cfg.offload_colocated or (cfg.offload_colocated is None and shares_gpu):
        return [
            f"RunConfig.async_rollout=True generates while the actor trains, but the actor and "
            f"rollout take turns on the GPUs of pool {pool!r} (RunConfig.offload_colocated="
            f"{cfg.offload_colocated}); give the rollout its own pool in RunConfig.role_pools "
            f"(e.g. rollout on GPU 1, actor on GPU 0) or set RunConfig.offload_colocated=False"
        ]
    return []
