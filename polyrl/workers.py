"""WorkerGroup: the Ray actors that host one role's TrainEngine.

One actor per rank for the torch backend (each a torch.distributed rank, started from
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), one actor for the JAX backend (a single
controller over the mesh's devices; on CPU it gets that many host devices through
XLA_FLAGS). Actors receive frozen config dataclasses resolved on the driver — never gin,
whose bindings do not reach other processes.

Dispatch: ``forward`` and ``train_step`` split a Batch into one equal shard per
data-parallel worker and gather the results (forward outputs concatenated in order;
train_step metrics are already all-reduced by the engines, so rank 0's are returned).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

__all__ = ["RoleSpec", "WorkerGroup", "EngineWorker", "backend_workers"]


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One role's engine: backend, model, optimizer (None = frozen) and parallelism."""

    name: str
    backend: str
    model: ModelConfig
    optim: OptimConfig | None
    parallel: ParallelConfig

    @property
    def num_workers(self) -> int:
        return backend_workers(self.backend, self.parallel)


def backend_workers(backend: str, parallel: ParallelConfig) -> int:
    """Ray workers a role starts: torch runs a process per device; a JAX controller
    drives every device of its mesh from one process."""
    return parallel.world_size if backend == "torch_fsdp" else 1


class EngineWorker:
    """Hosts one TrainEngine inside a Ray actor (or in-process, for tests)."""

    def __init__(self, backend: str, env: Mapping[str, str]):
        os.environ.update(env)
        from polyrl.backends.base import get_engine  # imports the framework here, lazily

        self.engine = get_engine(backend)()

    def init(self, model: ModelConfig, optim: OptimConfig | None, parallel: ParallelConfig) -> bool:
        self.engine.init(model, optim, parallel)
        return True

    def forward(self, batch: Batch, kwargs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return self.engine.forward(batch, **kwargs)

    def train_step(self, batch: Batch, loss_fn: Any, kwargs: Mapping[str, Any]) -> dict[str, float]:
        return self.engine.train_step(batch, loss_fn, **kwargs)

    def sync_weights(self, syncer: Any, bucket_bytes: int, version: int) -> Any:
        """Export this rank's buckets; rank 0 pushes them to the rollout servers with
        ``syncer`` (a ``polyrl.weight_sync.WeightSyncer``), the other ranks take part in
        the gathers and drop their copies. Returns rank 0's SyncStats (else None)."""
        buckets = self.engine.export_weights(bucket_bytes)
        if os.environ.get("RANK", "0") != "0":
            for _ in buckets:
                pass
            return None
        return syncer.push(buckets, version)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def ping(self) -> int:
        return os.getpid()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """The Ray actors of one role. ``ray`` must be initialised by the caller.

    options: rank -> Ray actor options (resources, scheduling strategy), e.g.
      ``polyrl.placement.Placement.options``; default half a CPU per worker.
    """

    def __init__(
        self,
        spec: RoleSpec,
        options: Callable[[int], dict[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 600.0,
    ):
        import ray

        self.spec = spec
        world = spec.num_workers
        port = _free_port()
        base_env = dict(env or {})
        options = options or (lambda rank: {"num_cpus": 0.5})
        if spec.backend == "jax_pjit" and not options(0).get("num_gpus"):
            base_env.setdefault(
                "XLA_FLAGS", f"--xla_force_host_platform_device_count={spec.parallel.world_size}"
            )
            base_env.setdefault("JAX_PLATFORMS", "cpu")
        remote = ray.remote(EngineWorker)
        self.workers = []
        for rank in range(world):
            rank_env = {
                **base_env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            self.workers.append(
                remote.options(**options(rank), runtime_env={"env_vars": rank_env}).remote(
                    spec.backend, rank_env
                )
            )
        # Engines of a torch world initialise together (the process group needs every rank).
        refs = [w.init.remote(spec.model, spec.optim, spec.parallel) for w in self.workers]
        try:
            ray.get(refs, timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"role {spec.name!r}: {world} {spec.backend} worker(s) did not start within "
                f"{ready_timeout_s:.0f} s. Ray resources: {ray.available_resources()}; each "
                f"worker asks for {options(0)}"
            ) from None

    @property
    def num_workers(self) -> int:
        """Ray workers of the role: the batch is split into one shard per worker."""
        return len(self.workers)

    def _shards(self, batch: Batch) -> list[Batch]:
        return batch.split(self.num_workers) if self.num_workers > 1 else [batch]

    def forward(self, batch: Batch, **kwargs: Any) -> dict[str, np.ndarray]:
        import ray

        outs = ray.get(
            [w.forward.remote(s, kwargs) for w, s in zip(self.workers, self._shards(batch))]
        )
        return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}

    def train_step(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        import ray

        outs = ray.get(
            [
                w.train_step.remote(s, loss_fn, kwargs)
                for w, s in zip(self.workers, self._shards(batch))
            ]
        )
        return outs[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([w.call.remote(method, *args) for w in self.workers])

    def sync_weights(self, syncer: Any, bucket_bytes: int, version: int) -> Any:
        """Push the role's weights to the rollout servers (see EngineWorker.sync_weights)."""
        import ray

        return ray.get(
            [w.sync_weights.remote(syncer, bucket_bytes, version) for w in self.workers]
        )[0]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
