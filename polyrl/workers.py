"""WorkerGroup: the Ray actors that host one role's TrainEngine.

How many actors a role starts, what each drives and how they form a collective group
is the backend's process model (``polyrl.backends.base.ENGINES[...].process``, read
through the role table ``polyrl.roles``): torch starts one actor per device (each a
torch.distributed rank), JAX one actor per host driving every local device of the
role's mesh (hosts joined by jax.distributed). Worker 0 reports its node's address and
a free port, and every worker joins the group from there. Actors receive frozen config
dataclasses resolved on the driver — never gin, whose bindings do not reach other
processes.

Dispatch: ``forward`` and ``train_step`` split a Batch into one equal shard per
worker and gather the results (forward outputs concatenated in order; train_step
metrics are already all-reduced by the engines, so worker 0's are returned).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from polyrl import faults
from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig
from polyrl.debug import place, setup_worker
from polyrl.reliability import WorkerDied
from polyrl.roles import RoleSpec
from polyrl.timeline import Traced

__all__ = ["WorkerGroup", "EngineWorker", "worker_options"]


class EngineWorker(Traced):
    """Hosts one TrainEngine inside a Ray actor (or in-process, for tests)."""

    def __init__(self, backend: str):
        self.backend, self.rank, self.engine = backend, 0, None
        self.forwards = 0  # forward calls so far (the ``kill_in_forward`` fault counts them)
        self.recording = None  # a running profiler (profile_start .. profile_stop)

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it: where the role's group meets."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(
        self,
        rank: int,
        env: Mapping[str, str],
        model: ModelConfig,
        optim: OptimConfig | None,
        parallel: ParallelConfig,
    ) -> bool:
        """Join the role's group (``env`` from the process model) and build the engine."""
        os.environ.update(env)
        from polyrl.backends.base import get_engine  # imports the framework here, lazily

        self.rank, self.role, self.model_path = rank, model.role, model.path
        setup_worker(model.role, rank)
        self.engine = get_engine(self.backend)()
        self.engine.init(model, optim, parallel)
        return True

    @place("forward")
    def forward(self, batch: Batch, kwargs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        self._fault("kill_in_forward", self.forwards)
        self.forwards += 1
        batch, kwargs = self._planted(batch, dict(kwargs))
        return self.engine.forward(batch, **kwargs)

    def _planted(self, batch: Batch, kwargs: dict[str, Any]) -> tuple[Batch, dict[str, Any]]:
        """Test-only (``polyrl.faults``): a wrong temperature or a broken attention mask
        in this backend's forwards (the faults the three-way check must name)."""
        scale = faults.values("temperature_scale", self.backend)
        if scale:
            kwargs["temperature"] = kwargs.get("temperature", 1.0) * max(scale) / 100
        if faults.values("broken_mask", self.backend):  # hide each row's first real token
            mask = np.array(batch["attention_mask"], copy=True)
            mask[np.arange(len(mask)), np.argmax(mask != 0, axis=1)] = 0
            batch = batch.with_columns({"attention_mask": mask})
        return batch, kwargs

    def load_weights(self, payloads: list[Any]) -> None:
        """Take another engine's weights (``host_buckets`` payloads: HF names, as exported
        to the rollout servers) into this frozen engine (the shadow check's)."""
        from polyrl.weight_sync import host_unpack

        self.engine.set_weights(
            {n: t.float().numpy() for bucket in payloads for n, t in host_unpack(*bucket)}
        )

    @place("train_step")
    def train_step(self, batch: Batch, loss_fn: Any, kwargs: Mapping[str, Any]) -> dict[str, float]:
        self._fault("kill_worker", self.engine.step)
        return self.engine.train_step(batch, loss_fn, **kwargs)

    def _fault(self, point: str, at: int) -> None:
        """Test-only (``polyrl.faults``): die if ``point`` is asked for this role (every
        rank) or this role and rank (``role:rank``) at ``at``."""
        if faults.active(point, at, self.role) or faults.active(
            point, at, f"{self.role}:{self.rank}"
        ):
            faults.kill_self()

    @place("sync_weights")
    def sync_weights(self, syncer: Any, bucket_bytes: int, version: int) -> Any:
        """Export this worker's buckets and push them with ``syncer`` (a
        ``polyrl.weight_sync.WeightSyncer``): with CUDA IPC every worker to the servers on
        its own GPU, otherwise worker 0 to every server. A worker with no server to push to
        takes part in the gathers and drops its copies. Returns this worker's SyncStats
        (None when it pushed nothing)."""
        syncer = syncer.for_rank(self.rank)
        buckets = self.engine.export_weights(bucket_bytes)
        if syncer is None or not syncer.servers:
            for _ in buckets:
                pass
            return None
        return syncer.push(buckets, version)

    def init_weight_group(self, syncer: Any) -> int:
        """Join ``syncer``'s weight-broadcast group as its rank 0 (transport "nccl")."""
        return syncer.init_group()

    def host_buckets(self, bucket_bytes: int) -> list[Any] | None:
        """The weights as object-store payloads (``weight_sync.host_payload``), from rank
        0; the other ranks take part in the gathers. Re-syncs a restarted rollout server."""
        from polyrl.weight_sync import host_payload

        payloads = [host_payload(b) for b in self.engine.export_weights(bucket_bytes)]
        return payloads if self.rank == 0 else None

    @place("export_hf")
    def export_hf(self, out_dir: str) -> None:
        """The engine's weights (``export_weights``) as an HF directory at ``out_dir``
        (``polyrl.backends.hf_dir.write_hf``): rank 0 writes, the others join the gathers."""
        from polyrl.backends.hf_dir import write_hf

        buckets = self.engine.export_weights(1 << 30)
        write_hf(buckets, self.model_path, out_dir, write=self.rank == 0)

    @place("call")
    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def gpu_memory(self) -> dict[str, Any] | None:
        """This worker's first GPU, device-wide (every process on it): ``{"gpu": node:index,
        "used": bytes, "total": bytes}``, from nvidia-smi so that no framework is asked;
        None without a GPU or nvidia-smi."""
        import subprocess

        import ray

        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if not gpu:
            return None
        query = [
            "nvidia-smi",
            "--query-gpu=memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ]
        try:
            out = subprocess.run(
                [*query, "-i", gpu], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            used, total = (int(float(v)) * 2**20 for v in out.strip().splitlines()[0].split(","))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
        node = ray.get_runtime_context().get_node_id()
        return {"gpu": f"{node}:{gpu}", "used": used, "total": total}

    def profile_start(self, out_dir: str, name: str) -> None:
        """Record what this worker runs from now on with its backend's profiler
        (``polyrl.profiler``; ``RunConfig.profile_steps``) until :meth:`profile_stop`."""
        from polyrl import profiler
        from polyrl.backends.base import get_backend

        self.recording = profiler.start(get_backend(self.backend).profiler, out_dir, name)

    def profile_stop(self) -> dict[str, Any]:
        """End the recording; its trace's path and top ops (``polyrl.profiler.summary``)."""
        recording, self.recording = self.recording, None
        if recording is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: profile_stop without profile_start")
        return recording.stop()

    def where(self) -> dict[str, str]:
        return where_this_runs()


def where_this_runs() -> dict[str, str]:
    """The Ray node this process runs on, the GPUs it sees (CUDA_VISIBLE_DEVICES) and the
    JAX platform it is pinned to (JAX_PLATFORMS)."""
    import ray

    env = os.environ.get
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": env("CUDA_VISIBLE_DEVICES", ""),
        "jax": env("JAX_PLATFORMS", ""),
    }


def worker_options(
    spec: RoleSpec,
    options: Callable[[int], dict[str, Any]],
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Ray actor options of each worker of ``spec``, in rank order: ``options(rank)``
    (resources, scheduling strategy, maybe the worker's own GPUs in ``runtime_env``) and a
    ``runtime_env`` holding the process model's host environment (e.g. ``JAX_PLATFORMS``
    pinned to the worker's platform), ``env``, then the rank's own variables."""
    on_gpu = bool(options(0).get("num_gpus"))
    base_env = {**spec.process.host_env(spec.local_devices, on_gpu), **(env or {})}
    if os.environ.get(faults.ENV):  # test-only fault hooks reach the workers too
        base_env.setdefault(faults.ENV, os.environ[faults.ENV])
    out = []
    for rank in range(spec.num_workers):
        opts = dict(options(rank))
        runtime = opts.pop("runtime_env", {})
        out.append(
            {**opts, "runtime_env": {"env_vars": {**base_env, **runtime.get("env_vars", {})}}}
        )
    return out


class Pending:
    """One role's Ray calls in flight (``WorkerGroup.submit_forward``)."""

    def __init__(self, group: WorkerGroup, refs: list[Any]):
        self.group, self.refs = group, refs

    def result(self) -> dict[str, np.ndarray]:
        """Wait for every worker; outputs concatenated in rank order (a dead worker raises
        :class:`WorkerDied`)."""
        outs = self.group._get(self.refs)
        return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


def gather(pending: Mapping[str, Pending]) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """``(name, result)`` of each pending call as it completes (first done, first out), so a
    caller can time each of several calls that run at once. A call whose worker failed is
    raised as soon as it fails (its other workers may wait forever in a collective)."""
    import ray

    left = dict(pending)
    while left:
        refs = [r for p in left.values() for r in p.refs]
        ray.wait(refs, num_returns=1)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for name, p in list(left.items()):
            done = [r for r in p.refs if r in ready]
            if len(done) == len(p.refs) or _failed(done):
                del left[name]
                yield name, p.result()


def _failed(refs: list[Any]) -> bool:
    import ray

    for ref in refs:
        try:
            ray.get(ref)
        except Exception:
            return True
    return False


class WorkerGroup:
    """The Ray actors of one role (``spec`` from the role table). ``ray`` must be
    initialised by the caller.

    options: rank -> Ray actor options (resources, scheduling strategy, a
      ``runtime_env`` with the worker's devices), e.g. ``polyrl.placement.Placement.options``;
      default half a CPU per worker. env: extra environment for every worker.
    """

    def __init__(
        self,
        spec: RoleSpec,
        options: Callable[[int], dict[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 600.0,
    ):
        import ray

        from polyrl.backends.base import GroupSlot

        self.spec = spec
        world, process = spec.num_workers, spec.process
        options = options or (lambda rank: {"num_cpus": 0.5})
        remote = ray.remote(EngineWorker)
        self.workers = [
            remote.options(**opts).remote(spec.backend)
            for opts in worker_options(spec, options, env)
        ]
        # The workers of a group initialise together (the group needs every member).
        try:
            addr, port = ray.get(self.workers[0].rendezvous.remote(), timeout=ready_timeout_s)
            refs = []
            for rank, worker in enumerate(self.workers):
                slot = GroupSlot(rank, world, *spec.slot(rank), addr, port)
                refs.append(
                    worker.start.remote(
                        rank, process.group_env(slot), spec.model, spec.optim, spec.parallel
                    )
                )
            ray.get(refs, timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"role {spec.name!r}: {world} {spec.backend} worker(s) did not start within "
                f"{ready_timeout_s:.0f} s. Ray resources: {ray.available_resources()}; each "
                f"worker asks for {options(0)}"
            ) from None

    def _get(self, refs: list[Any]) -> list[Any]:
        """``ray.get(refs)`` (one ref per worker, in rank order), but a dead worker raises
        :class:`WorkerDied` at once, naming the role and rank, even while the other ranks
        wait forever in a collective it will never join."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise WorkerDied(self.spec.name, refs.index(done[0]), type(e).__name__) from e
            except ray.exceptions.RayTaskError:
                self._name_the_dead(refs, pending)
                raise
        return ray.get(refs)

    def _name_the_dead(self, refs: list[Any], pending: list[Any]) -> None:
        """A rank's call failed. When a peer died, the live ranks' collective fails too
        (gloo: connection reset), often before Ray reports the death: if another rank's
        call ends with its worker dead within 30 s, raise :class:`WorkerDied` for it (the
        cause) instead of the failed call's error (the symptom)."""
        import time

        import ray

        deadline = time.monotonic() + 30.0
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise WorkerDied(self.spec.name, refs.index(ref), type(e).__name__) from e
                except ray.exceptions.RayTaskError:
                    pass  # another live rank's failed collective

    @property
    def num_workers(self) -> int:
        """Ray workers of the role: the batch is split into one shard per worker."""
        return len(self.workers)

    def _shards(self, batch: Batch) -> list[Batch]:
        return batch.split(self.num_workers) if self.num_workers > 1 else [batch]

    def forward(self, batch: Batch, **kwargs: Any) -> dict[str, np.ndarray]:
        return self.submit_forward(batch, **kwargs).result()

    def submit_forward(self, batch: Batch, **kwargs: Any) -> Pending:
        """Start :meth:`forward` without waiting: forwards of roles on different devices
        run at once (``gather``)."""
        refs = [w.forward.remote(s, kwargs) for w, s in zip(self.workers, self._shards(batch))]
        return Pending(self, refs)

    def train_step(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:

        outs = self._get(
            [
                w.train_step.remote(s, loss_fn, kwargs)
                for w, s in zip(self.workers, self._shards(batch))
            ]
        )
        return outs[0]

    def gpu_memory(self) -> list[dict[str, Any] | None]:
        """Each worker's ``EngineWorker.gpu_memory``."""
        import ray

        return ray.get([w.gpu_memory.remote() for w in self.workers])

    def export_hf(self, out_dir: str) -> None:
        """Write the role's weights as an HF directory (``EngineWorker.export_hf``)."""
        self._get([w.export_hf.remote(out_dir) for w in self.workers])

    def call_all(self, method: str, *args: Any) -> list[Any]:

        return self._get([w.call.remote(method, *args) for w in self.workers])

    def sync_weights(self, syncer: Any, bucket_bytes: int, version: int) -> Any:
        """Push the role's weights to the rollout servers (see EngineWorker.sync_weights);
        the SyncStats of every pushing rank, merged."""
        from polyrl.weight_sync import SyncStats

        parts = self._get(
            [w.sync_weights.remote(syncer, bucket_bytes, version) for w in self.workers]
        )
        stats = SyncStats.merge([p for p in parts if p is not None] or [SyncStats(version, "")])
        if stats.servers != len(syncer.servers):
            raise RuntimeError(
                f"weight sync ({syncer.transport}) reached {stats.servers} of "
                f"{len(syncer.servers)} rollout servers: with cuda_ipc every server must share "
                f"a GPU with a trainer rank (server GPUs {syncer.devices}); colocate them or "
                f"set RunConfig.weight_transport='nccl' (separate GPUs)"
            )
        return stats

    def form_weight_group(self, syncer: Any) -> None:
        """Rank 0 joins ``syncer``'s broadcast group (``WeightSyncer.ensure_group``)."""
        import ray

        ray.get(self.workers[0].init_weight_group.remote(syncer))

    def host_buckets(self, bucket_bytes: int) -> list[list[tuple[str, Any]]]:
        """The role's weights as buckets of host tensors, in this process."""
        import ray

        from polyrl.weight_sync import host_unpack

        payloads = ray.get([w.host_buckets.remote(bucket_bytes) for w in self.workers])[0]
        return [host_unpack(arrays, metas) for arrays, metas in payloads]

    def load_weights_from(self, source: WorkerGroup, bucket_bytes: int) -> None:
        """Give every worker of this (frozen) group ``source``'s current weights, moved
        as the rollout re-sync moves them (``host_buckets`` through the object store)."""
        refs = [w.host_buckets.remote(bucket_bytes) for w in source.workers]
        source._get(refs)  # every source rank joins the gathers; rank 0 holds the payloads
        self._get([w.load_weights.remote(refs[0]) for w in self.workers])

    def shutdown(self) -> None:
        from polyrl.ray_session import end_actors

        end_actors(self.workers)
        self.workers = []
