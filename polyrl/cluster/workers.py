"""The engine roles' workers: an :class:`EngineGroup` of :class:`EngineWorker` actors.

How many actors a role starts, what each drives and how they form a collective group
is the backend's process model (``polyrl.backends.base.ENGINES[...].process``, read
through the role table ``polyrl.cluster.roles``): torch starts one actor per device (each a
torch.distributed rank), JAX one actor per host driving every local device of the
role's mesh (hosts joined by jax.distributed). Worker 0 reports its node's address and
a port (``WorkerGroup.rendezvous``; a torch group's worker 0 keeps it listening until
its store takes it over, ``polyrl.backends.base.ProcessModel.listen``), and every worker
joins the group from there.
Actors receive frozen config dataclasses resolved on the driver — never gin, whose
bindings do not reach other processes.

An EngineGroup is a ``polyrl.cluster.groups.WorkerGroup``: creation, placement, dispatch,
dead-worker reports live there. Each EngineWorker method declares its dispatch:
``forward``, ``train_step`` and ``forward_backward`` split a Batch into one equal shard
per worker (forward outputs concatenated in order; train_step metrics are already
all-reduced by the engines, so worker 0's are returned); the rest run on every worker.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from polyrl import faults
from polyrl.batch import Batch
from polyrl.cluster.groups import Calls, Collect, Dispatch, WorkerGroup, register
from polyrl.cluster.roles import RoleSpec
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig
from polyrl.observe.debug import place, setup_worker
from polyrl.observe.timeline import Traced

__all__ = ["EngineGroup", "EngineWorker", "engine_env"]


class EngineWorker(Traced):
    """Hosts one TrainEngine inside a Ray actor (or in-process, for tests)."""

    def __init__(self, backend: str, rank: int = 0):
        self.backend, self.rank, self.engine = backend, rank, None
        self.forwards = 0  # forward calls so far (the ``kill_in_forward`` fault counts them)
        self.recording = None  # a running profiler (profile_start .. profile_stop)

    @register(Dispatch.EACH)
    def start(
        self,
        env: Mapping[str, str],
        model: ModelConfig,
        optim: OptimConfig | None,
        parallel: ParallelConfig,
    ) -> bool:
        """Join the role's group (``env`` from the process model) and build the engine.
        Called again (a warm session's worker, for each run attached to it:
        ``polyrl.cluster.session``), the group joined first stays and the engine is built
        anew: the model's initial weights, a fresh optimizer."""
        if self.engine is not None:  # free the last run's engine before the new one loads
            self.engine, self.forwards = None, 0
            gc.collect()
        os.environ.update(env)
        from polyrl.backends.base import get_engine  # imports the framework here, lazily

        self.role, self.model_path = model.role, model.path
        self.value_head = model.has_value_head
        setup_worker(model.role, self.rank)
        self.engine = get_engine(self.backend)()
        self.engine.init(model, optim, parallel)
        return True

    @register(Dispatch.SPLIT, Collect.FIRST)
    def warm_up(self, batch: Batch, method: str, *args: Any, **kwargs: Any) -> float:
        """``TrainEngine.warm_up``: prepare what ``method`` will run on batches shaped like
        this shard (the trainer's first step); the seconds it took."""
        t0 = time.perf_counter()
        self.engine.warm_up(method, batch, *args, **kwargs)
        return time.perf_counter() - t0

    @register(Dispatch.SPLIT, Collect.CONCAT)
    @place("forward")
    def forward(self, batch: Batch, **kwargs: Any) -> dict[str, np.ndarray]:
        self._fault("kill_in_forward", self.forwards)
        self.forwards += 1
        batch, kwargs = self._planted(batch, kwargs)
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
        """Take another engine's weights (``host_buckets`` payloads, or the object-store
        refs of a rollout push's retained buckets: HF names, as exported to the rollout
        servers) into this frozen engine (the shadow check's)."""
        import ray

        from polyrl.weight_sync import host_unpack

        def arrays(a: Any) -> Any:
            return ray.get(a) if isinstance(a, ray.ObjectRef) else a

        self.engine.set_weights(
            {n: t.float().numpy() for a, m in payloads for n, t in host_unpack(arrays(a), m)}
        )

    @register(Dispatch.SPLIT, Collect.FIRST)
    @place("train_step")
    def train_step(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        self._fault("kill_worker", self.engine.step)
        return self.engine.train_step(batch, loss_fn, **kwargs)

    @register(Dispatch.SPLIT, Collect.ALL)
    def forward_backward(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, Any]:
        """``TrainEngine.forward_backward`` on this worker's shard (no optimizer step)."""
        return self.engine.forward_backward(batch, loss_fn, **kwargs)

    @register(Dispatch.ALL, Collect.FIRST)
    def optim_step(self, optim: OptimConfig) -> dict[str, float]:
        """``TrainEngine.optim_step`` with ``optim``'s hyper-parameters."""
        return self.engine.optim_step(optim)

    def _fault(self, point: str, at: int) -> None:
        """Test-only (``polyrl.faults``): die if ``point`` is asked for this role (every
        rank) or this role and rank (``role:rank``) at ``at``."""
        if faults.active(point, at, self.role) or faults.active(
            point, at, f"{self.role}:{self.rank}"
        ):
            faults.kill_self()

    @place("sync_weights")
    def sync_weights(
        self, syncer: Any, bucket_bytes: int, version: int, trained_only: bool = False
    ) -> Any:
        """Export this worker's buckets and push them with ``syncer`` (a
        ``polyrl.weight_sync.WeightSyncer``): with CUDA IPC every worker to the servers on
        its own GPU, otherwise worker 0 to every server. A worker with no server to push to
        takes part in the gathers and drops its copies. ``trained_only``: only the tensors
        training changes (``TrainEngine.export_weights``). Returns this worker's SyncStats
        (None when it pushed nothing)."""
        syncer = syncer.for_rank(self.rank)
        buckets = self.engine.export_weights(bucket_bytes, trained_only=trained_only)
        if syncer is None or not syncer.servers:
            for _ in buckets:
                pass
            return None
        return syncer.push(buckets, version)

    @register(Dispatch.ONE, Collect.FIRST)
    def init_weight_group(self, syncer: Any) -> int:
        """Join ``syncer``'s weight-broadcast group as its rank 0 (transport "nccl")."""
        return syncer.init_group()

    @register(Dispatch.ALL, Collect.FIRST)
    def host_buckets(self, bucket_bytes: int) -> list[Any] | None:
        """The weights as object-store payloads (``weight_sync.host_payload``), from rank
        0; the other ranks take part in the gathers. Re-syncs a restarted rollout server."""
        from polyrl.weight_sync import host_payload

        payloads = [host_payload(b) for b in self.engine.export_weights(bucket_bytes)]
        return payloads if self.rank == 0 else None

    @place("export_hf")
    def export_hf(self, out_dir: str) -> None:
        """The engine's weights (``export_weights``) as an HF directory at ``out_dir``
        (``polyrl.backends.hf_dir.write_hf``; a value model's as its sequence classifier):
        rank 0 writes, the others join the gathers."""
        from polyrl.backends.hf_dir import write_hf

        buckets = self.engine.export_weights(1 << 30)
        write_hf(
            buckets, self.model_path, out_dir, write=self.rank == 0, value_head=self.value_head
        )

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
        (``polyrl.observe.profiler``; ``RunConfig.profile_steps``) until :meth:`profile_stop`."""
        from polyrl.backends.base import get_backend
        from polyrl.observe import profiler

        self.recording = profiler.start(get_backend(self.backend).profiler, out_dir, name)

    def profile_stop(self) -> dict[str, Any]:
        """End the recording; its trace's path and top ops (``polyrl.observe.profiler.summary``)."""
        recording, self.recording = self.recording, None
        if recording is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: profile_stop without profile_start")
        return recording.stop()


def engine_env(
    spec: RoleSpec, options: Callable[[int], dict[str, Any]], env: Mapping[str, str] | None
) -> dict[str, str]:
    """Environment of every worker of ``spec``: the process model's host environment
    (e.g. ``JAX_PLATFORMS`` pinned to the worker's platform), then ``env``."""
    on_gpu = bool(options(0).get("num_gpus"))
    return {**spec.process.host_env(spec.local_devices, on_gpu), **(env or {})}


class EngineGroup(WorkerGroup):
    """The :class:`EngineWorker` actors of one role (``spec`` from the role table), joined
    in one collective group. ``ray`` must be initialised by the caller.

    options: rank -> Ray actor options (resources, scheduling strategy, a
      ``runtime_env`` with the worker's devices), e.g. ``polyrl.cluster.placement.Placement.options``;
      default half a CPU per worker. env: extra environment for every worker.
    wait: return once every worker has built its engine; False returns at once, and
      :meth:`ready` waits (roles then start side by side).
    """

    def __init__(
        self,
        spec: RoleSpec,
        options: Callable[[int], dict[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 600.0,
        wait: bool = True,
    ):
        from polyrl.backends.base import GroupSlot

        self.spec = spec
        world, process = spec.num_workers, spec.process
        options = options or (lambda rank: {"num_cpus": 0.5})
        super().__init__(
            spec.name,
            EngineWorker,
            (spec.backend,),
            num_workers=world,
            options=options,
            env=engine_env(spec, options, env),
            ready_timeout_s=ready_timeout_s,
        )
        # The workers of a group initialise together (the group needs every member). A
        # world of one meets no one (torch: an in-memory store), so it keeps no port.
        addr, port = self.rendezvous(listen=process.listen if world > 1 else None)
        envs = [
            process.group_env(GroupSlot(rank, world, *spec.slot(rank), addr, port))
            for rank in range(world)
        ]
        self._starting = self.submit("start", envs, spec.model, spec.optim, spec.parallel)
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until every worker has built its engine (``wait=False``: the caller
        started other roles meanwhile); a worker that fails to start ends the group."""
        if self._starting is not None:
            self.started(self._starting)
            self._starting = None

    def submit_warm_up(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> Calls:
        """Start ``EngineWorker.warm_up`` for ``method(batch, *args, **kwargs)`` without
        waiting; each worker gets the shard the real call would give it."""
        return self.submit("warm_up", batch, method, *args, **kwargs)

    def forward(self, batch: Batch, **kwargs: Any) -> dict[str, np.ndarray]:
        return self.submit_forward(batch, **kwargs).result()

    def submit_forward(self, batch: Batch, **kwargs: Any) -> Calls:
        """Start :meth:`forward` without waiting: forwards of roles on different devices
        run at once (``polyrl.cluster.groups.gather``)."""
        return self.submit("forward", batch, **kwargs)

    def train_step(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        return self.call("train_step", batch, loss_fn, **kwargs)

    def forward_backward(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, Any]:
        """Gradients of ``loss_fn`` on ``batch`` (one equal shard per worker: pad it to a
        multiple of the workers with rows whose ``response_mask`` is 0) added to those
        pending since the last :meth:`optim_step`: ``log_probs`` [B, R] in input order and
        the loss's and metrics' sums (already over every rank: worker 0's)."""
        parts = self.call("forward_backward", batch, loss_fn, **kwargs)
        log_probs = np.concatenate([p["log_probs"] for p in parts])
        return {**parts[0], "log_probs": log_probs}

    def optim_step(self, optim: OptimConfig) -> dict[str, float]:
        """One optimizer update of every worker from the pending gradients, with
        ``optim``'s hyper-parameters: ``grad_norm`` and ``lr``."""
        return self.call("optim_step", optim)

    def gpu_memory(self) -> list[dict[str, Any] | None]:
        """Each worker's ``EngineWorker.gpu_memory``."""
        return self.call("gpu_memory")

    def export_hf(self, out_dir: str) -> None:
        """Write the role's weights as an HF directory (``EngineWorker.export_hf``)."""
        self.call("export_hf", out_dir)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``engine.<method>(*args)`` on every worker."""
        return self.call("call", method, *args)

    def sync_weights(
        self, syncer: Any, bucket_bytes: int, version: int, trained_only: bool = False
    ) -> Any:
        """Push the role's weights to the rollout servers (see EngineWorker.sync_weights);
        the SyncStats of every pushing rank, merged."""
        from polyrl.weight_sync import SyncStats

        parts = self.call("sync_weights", syncer, bucket_bytes, version, trained_only)
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
        self.call("init_weight_group", syncer)

    def host_buckets(self, bucket_bytes: int) -> list[list[tuple[str, Any]]]:
        """The role's weights as buckets of host tensors, in this process."""
        from polyrl.weight_sync import host_unpack

        payloads = self.call("host_buckets", bucket_bytes)
        return [host_unpack(arrays, metas) for arrays, metas in payloads]

    def load_weights_from(
        self, source: EngineGroup, bucket_bytes: int, pushed: list[Any] | None = None
    ) -> None:
        """Give every worker of this (frozen) group ``source``'s current weights: the
        object-store buckets a rollout push of them retained (``pushed``: [(payload ref,
        metas)], ``SyncStats.retained``), read in place, or else a fresh export moved as the
        rollout re-sync moves it (``host_buckets`` through the object store)."""
        if pushed is None:
            calls = source.submit("host_buckets", bucket_bytes)
            calls.result()  # every source rank joins the gathers; rank 0 holds the payloads
            payloads: Any = calls.refs[0]
        else:
            payloads = list(pushed)
        self.call("load_weights", payloads)
