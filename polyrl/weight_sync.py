"""Bucketed trainer -> rollout weight transfer.

A trainer's ``TrainEngine.export_weights(bucket_bytes)`` yields buckets: lists of
``(hf_name, array)`` with full tensors under Hugging Face names — ``torch.Tensor``
from the torch backend, ``jax.Array`` from the JAX backend. :class:`WeightSyncer`
streams them to every rollout server's vLLM workers, which load them in place
(``polyrl.rollout.worker_ext``); each server then resets its prefix cache and bumps
its weight version.

Arrays become torch tensors through DLPack (:func:`to_torch`: zero-copy where the
array allows it, a numpy copy otherwise), so buckets from either backend take the
same path.

Transports (:data:`TRANSPORTS`):

* ``"object_store"`` — each bucket is ``ray.put`` once (host shared memory, one copy;
  Ray moves it between nodes) and every server reads it zero-copy. Works on CPU and
  across nodes. The pushed buckets can be *retained* (kept as object refs) so a
  server that Ray restarts is re-synced from them (:meth:`WeightSyncer.replay`).
* ``"cuda_ipc"`` — colocated trainer and server on the same GPU: each bucket is
  packed into one flat device buffer whose CUDA IPC handle the workers open in place
  (no copy off the GPU). Trainer rank 0 pushes (``EngineWorker.sync_weights``), so the
  servers must share rank 0's GPU.
* ``"nccl"`` — trainer and servers on separate GPUs: rank 0 of the trainer
  broadcasts each flat bucket to every server worker over a NCCL group set up by
  :meth:`WeightSyncer.init_nccl`.

The GPU transports are covered by ``gpu``-marked tests (run on a lent H200 pair).

Buckets are streamed: the next bucket is packed while servers load the previous one,
so besides retained buckets at most two are alive at a time.

This module is controller core: torch, jax and ray are imported inside functions.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = [
    "TRANSPORTS",
    "SyncStats",
    "TensorMeta",
    "WeightSyncer",
    "iter_buckets",
    "pack_flat",
    "to_torch",
    "unpack_flat",
]

TRANSPORTS = ("object_store", "cuda_ipc", "nccl")

# (hf_name, torch dtype name, shape, byte offset in the bucket's flat buffer, nbytes)
TensorMeta = tuple[str, str, tuple[int, ...], int, int]


# ------------------------------------------------------------ array conversion
def to_torch(x: Any):
    """A ``torch.Tensor`` viewing ``x`` (torch, jax or numpy array).

    torch tensors pass through; anything with ``__dlpack__`` (jax.Array on one
    device) is wrapped without a copy; otherwise (a sharded jax.Array, numpy with
    ml_dtypes' bfloat16, ...) the array is materialised with numpy and wrapped.
    """
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError, ValueError):
            pass  # e.g. an array sharded over several devices has no single buffer
    return _numpy_to_torch(x)


def _numpy_to_torch(x: Any):
    import numpy as np
    import torch

    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":  # ml_dtypes: same bits, torch has no numpy bf16
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    if not arr.flags.writeable:  # jax hands out read-only host copies; torch wants writable
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr))


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def pack_flat(bucket: Sequence[tuple[str, Any]], device: Any = None):
    """One contiguous uint8 tensor holding every tensor of ``bucket`` (one copy), and
    the :data:`TensorMeta` list that :func:`unpack_flat` reads it back with.

    ``device`` defaults to the first tensor's device; offsets are 256-byte aligned so
    every view is aligned for any dtype.
    """
    import torch

    tensors = [(name, to_torch(a)) for name, a in bucket]
    if not tensors:
        raise ValueError("pack_flat: empty bucket; export_weights must not yield empty buckets")
    device = tensors[0][1].device if device is None else torch.device(device)
    metas: list[TensorMeta] = []
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // 256) * 256
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, off, nbytes) in zip(tensors, metas):
        flat[off : off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, metas


def unpack_flat(flat: Any, metas: Sequence[TensorMeta]) -> list[tuple[str, Any]]:
    """Views into ``flat`` (a uint8 tensor) as ``(name, tensor)`` pairs: no copy."""
    return [
        (name, flat[off : off + nbytes].view(_dtype(dtype)).reshape(shape))
        for name, dtype, shape, off, nbytes in metas
    ]


def _as_uint8_numpy(t: Any):
    """A uint8 numpy view of a tensor's bytes (copied off the GPU if needed)."""
    return t.detach().contiguous().reshape(-1).cpu().view(_dtype("uint8")).numpy()


def host_payload(bucket: Sequence[tuple[str, Any]]) -> tuple[list[Any], list[TensorMeta]]:
    """``bucket`` as uint8 numpy views (no copy for CPU tensors) plus metadata, the
    form Ray's object store moves out-of-band (``ray.put`` then copies once)."""
    arrays, metas = [], []
    for name, a in bucket:
        t = to_torch(a)
        nbytes = t.numel() * t.element_size()
        arrays.append(_as_uint8_numpy(t))
        metas.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), 0, nbytes))
    return arrays, metas


def host_unpack(arrays: Sequence[Any], metas: Sequence[TensorMeta]) -> list[tuple[str, Any]]:
    """Inverse of :func:`host_payload`: torch views of (read-only) numpy buffers."""
    import torch

    out = []
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; the tensors are only read (copied
        # into vLLM's parameters), so sharing the buffer is safe.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for arr, (name, dtype, shape, _, _) in zip(arrays, metas):
            out.append((name, torch.from_numpy(arr).view(_dtype(dtype)).reshape(shape)))
    return out


def iter_buckets(
    named: Iterable[tuple[str, Any]], bucket_bytes: int
) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, array)`` pairs into buckets of about ``bucket_bytes`` (a tensor
    larger than that gets a bucket of its own). For sources other than an engine's
    ``export_weights``, e.g. a transformers ``state_dict().items()``."""
    if bucket_bytes <= 0:
        raise ValueError(f"iter_buckets: bucket_bytes={bucket_bytes} must be > 0")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, a in named:
        n = int(a.nbytes)  # torch, numpy and jax arrays all have it
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, a))
        size += n
    if bucket:
        yield bucket


# ---------------------------------------------------------------------- stats
@dataclasses.dataclass
class SyncStats:
    """One push: what moved and how fast (``gbps`` = bytes / seconds / 1e9)."""

    version: int
    transport: str
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    servers: int = 0
    # Object-store transport with retain=True: [(payload ref, metas)] per bucket, what
    # WeightSyncer.replay needs to re-sync a restarted server.
    retained: list[tuple[Any, list[TensorMeta]]] | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    def summary(self) -> dict[str, float | int | str]:
        return {
            "version": self.version,
            "transport": self.transport,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "buckets": self.buckets,
            "seconds": self.seconds,
            "servers": self.servers,
            "gbps": self.gbps,
        }


# --------------------------------------------------------------------- syncer
class WeightSyncer:
    """Pushes buckets to rollout servers (Ray actor handles of ``RolloutServer``).

    Picklable, so the controller can build it (``RolloutPool.weight_syncer``) and send
    it to the trainer worker that holds the exported tensors; it must run in that
    process for ``cuda_ipc`` (the handles are of its GPU memory) and ``nccl`` (it is
    rank 0 of the broadcast group).

    retain: keep object-store buckets for :meth:`replay` (costs one host copy of the
      model in Ray's object store; needed to re-sync restarted servers without the
      trainer).
    """

    def __init__(
        self,
        servers: Sequence[Any],
        transport: str = "object_store",
        *,
        retain: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"WeightSyncer: transport={transport!r} is not one of {list(TRANSPORTS)}"
            )
        self.servers = list(servers)
        self.transport = transport
        self.retain = retain and transport == "object_store"
        self.timeout_s = timeout_s
        self._comm = None  # NCCL communicator (rank 0), process-local

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_comm": None}

    # ------------------------------------------------------------- push
    def push(self, buckets: Iterable[Sequence[tuple[str, Any]]], version: int) -> SyncStats:
        """Stream ``buckets`` to every server; returns when all loaded them and set
        their weight version to ``version``."""
        stats = SyncStats(
            version=version,
            transport=self.transport,
            servers=len(self.servers),
            retained=[] if self.retain else None,
        )
        start = time.perf_counter()
        self._get([s.begin_weight_update.remote() for s in self.servers])
        pending: list[Any] = []
        keep: Any = None  # the previous bucket's device buffer, alive until loaded
        for bucket in buckets:
            refs, buf = self._send(bucket, stats)
            self._get(pending)  # overlap: servers loaded bucket i-1 while we packed bucket i
            pending, keep = refs, buf
        self._get(pending)
        del keep
        self._get([s.finish_weight_update.remote(version) for s in self.servers])
        stats.seconds = time.perf_counter() - start
        return stats

    def replay(
        self,
        retained: Sequence[tuple[Any, list[TensorMeta]]],
        version: int,
        servers: Sequence[Any] | None = None,
    ) -> None:
        """Re-send retained object-store buckets (``SyncStats.retained``) to ``servers``
        (default: all), e.g. a server Ray just restarted."""
        targets = self.servers if servers is None else list(servers)
        self._get([s.begin_weight_update.remote() for s in targets])
        for ref, metas in retained:
            self._get([s.load_bucket.remote(ref, metas) for s in targets])
        self._get([s.finish_weight_update.remote(version) for s in targets])

    def _send(self, bucket: Sequence[tuple[str, Any]], stats: SyncStats) -> tuple[list[Any], Any]:
        """Start loading one bucket on every server; returns (ack refs, buffer to keep)."""
        if self.transport == "object_store":
            refs, buf, metas = self._send_object_store(bucket, stats)
        elif self.transport == "cuda_ipc":
            refs, buf, metas = self._send_ipc(bucket)
        else:
            refs, buf, metas = self._send_nccl(bucket)
        stats.buckets += 1
        stats.tensors += len(metas)
        stats.bytes += sum(m[4] for m in metas)
        return refs, buf

    def _send_object_store(self, bucket, stats: SyncStats):
        import ray

        arrays, metas = host_payload(bucket)
        ref = ray.put(arrays)
        if stats.retained is not None:
            stats.retained.append((ref, metas))
        return [s.load_bucket.remote(ref, metas) for s in self.servers], None, metas

    def _send_ipc(self, bucket):
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        flat, metas = pack_flat(bucket)
        if flat.device.type != "cuda":
            raise ValueError(
                f"WeightSyncer(transport='cuda_ipc'): bucket tensors are on {flat.device}, "
                f"CUDA IPC needs CUDA tensors; use transport='object_store' for host tensors"
            )
        uuid = str(torch.cuda.get_device_properties(flat.device).uuid)
        handles = {uuid: reduce_tensor(flat)}
        torch.cuda.synchronize(flat.device)  # the copy into flat must land before workers read
        return [s.load_bucket_ipc.remote(handles, metas) for s in self.servers], flat, metas

    def _send_nccl(self, bucket):
        import torch

        if self._comm is None:
            raise RuntimeError(
                "WeightSyncer(transport='nccl'): call init_nccl(host, port) in this process "
                "before push(); the broadcast group is process-local"
            )
        flat, metas = pack_flat(bucket, device=torch.device("cuda", torch.cuda.current_device()))
        refs = [s.load_bucket_nccl.remote(metas, int(flat.numel())) for s in self.servers]
        self._comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        return refs, flat, metas

    # ------------------------------------------------------------- NCCL setup
    def init_nccl(self, host: str, port: int) -> int:
        """Form the broadcast group: this process is rank 0, then every worker of every
        server in order. Returns the group size."""
        import ray
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if self.transport != "nccl":
            raise ValueError(f"WeightSyncer.init_nccl: transport is {self.transport!r}, not 'nccl'")
        sizes = self._get([s.num_workers.remote() for s in self.servers])
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        refs = [
            s.init_weight_group.remote(host, port, off, world)
            for s, off in zip(self.servers, offsets)
        ]
        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world)
        self._comm = PyNcclCommunicator(group, device=torch.cuda.current_device())
        ray.get(refs, timeout=self.timeout_s)
        return world

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray

        if not refs:
            return []
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"weight sync ({self.transport}): servers did not answer within "
                f"{self.timeout_s:.0f} s; raise WeightSyncer(timeout_s=...) for large models"
            ) from e
