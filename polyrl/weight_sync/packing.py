"""Weight buckets in every transport's form.

A bucket (``polyrl.backends.buckets``) is a sequence of ``(hf_name, array)`` with full
tensors under Hugging Face names (``TrainEngine.export_weights``). This module turns one
into the forms the transports move: torch tensors (:func:`to_torch`), one flat uint8
buffer plus ``TensorMeta`` (:func:`pack_flat` / :func:`unpack_flat`), uint8 host
arrays for Ray's object store (:func:`host_payload` / :func:`host_unpack`), or one flat
file in host shared memory that another process of the node maps (:func:`shared_file` /
:func:`map_shared`: a rollout server hands a bucket to its engine's workers so).

Torch tensors are the transports' own form (vLLM is a torch program). A backend whose
arrays are something else has an *array bridge* in its registry entry
(``polyrl.backends.base``, ``Backend.arrays``) that gathers an array onto one device and
packs a bucket of them there; an engine's export bucket may pack itself (``OwnBucket``).
So this module names no backend.

Controller core: torch is imported inside functions.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from polyrl.backends.buckets import LazyPairs, OwnBucket, TensorMeta, aligned

__all__ = [
    "to_torch",
    "device_of",
    "pack_flat",
    "unpack_flat",
    "host_payload",
    "host_unpack",
    "shared_file",
    "map_shared",
]


# ------------------------------------------------------------ array conversion
def _bridge(x: Any) -> Any:
    """The array bridge of the backend whose array ``x`` is (None: torch, numpy, ...)."""
    from polyrl.backends.base import array_bridge

    return array_bridge(x)


def to_torch(x: Any):
    """A ``torch.Tensor`` viewing ``x`` (torch, a backend's or numpy array).

    torch tensors pass through; anything with ``__dlpack__`` (a jax.Array) is wrapped
    without a copy. A backend's array on several of this process's devices is first
    gathered onto one of them by its bridge (``on_one_device``: a device-to-device
    transfer, no host round trip), then wrapped the same way. Anything else (numpy with
    ml_dtypes' bfloat16, an array with shards on other processes, ...) is materialised
    with numpy.
    """
    import torch

    if isinstance(x, torch.Tensor):
        return x
    bridge = _bridge(x)
    if bridge is not None:
        x = bridge.on_one_device(x)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError, ValueError):
            pass  # e.g. a dtype DLPack cannot carry
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


def device_of(x: Any):
    """The torch device an array lives on (a backend's array: its first device, as torch
    names it)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.device
    bridge = _bridge(x)
    if bridge is not None:
        return bridge.torch_device(x)
    return to_torch(x).device


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def pack_flat(bucket: Sequence[tuple[str, Any]], device: Any = None, *, alloc: Any = None):
    """One contiguous uint8 tensor holding every tensor of ``bucket`` (one copy), and
    the :data:`TensorMeta` list that :func:`unpack_flat` reads it back with.

    ``device`` defaults to the first tensor's device; offsets are 256-byte aligned so
    every view is aligned for any dtype (the padding is never written: its bytes are
    whatever the buffer held, and no reader looks at them). ``alloc(nbytes, device)``, if given, returns
    the uint8 buffer to pack into (it may be longer; the result is its first
    ``nbytes``), e.g. a persistent CUDA IPC buffer (``polyrl.weight_sync.cuda_ipc._ipc_slot``). An
    :class:`OwnBucket` packs itself; a bucket of a backend's arrays is packed by its
    bridge on the arrays' device where it can (JAX: one program, sharded arrays gathered
    on device), which on GPU writes straight into the buffer.
    """
    import torch

    if not bucket:
        raise ValueError("pack_flat: empty bucket; export_weights must not yield empty buckets")
    alloc_or_new = alloc or _empty_bytes
    if isinstance(bucket, OwnBucket):
        packed = bucket.pack(alloc_or_new)
    else:
        bridge = _bridge(bucket[0][1])
        packed = None if bridge is None else bridge.pack(bucket, alloc_or_new)
    if packed is not None:
        flat, metas = packed
        return (flat if device is None else flat.to(device)), metas
    tensors = [(name, to_torch(a)) for name, a in bucket]
    device = tensors[0][1].device if device is None else torch.device(device)
    key, metas, nbytes = _layout(tensors)
    buffer = alloc_or_new(nbytes, device)
    _copy_in(buffer, key, metas, tensors, cache=alloc is not None)
    return buffer[:nbytes], metas


def _copy_in(buffer: Any, key: tuple, metas: Sequence[TensorMeta], tensors: list, cache: bool):
    """Copy ``tensors`` into their places in ``buffer`` (layout ``key``, ``metas``)."""
    import torch

    with torch.no_grad():  # one multi-tensor copy (a launch or two, not one per tensor)
        torch._foreach_copy_(_views(buffer, key, metas, cache), [t for _, t in tensors])


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
            offset += aligned(nbytes)
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


def unpack_flat(flat: Any, metas: Sequence[TensorMeta]) -> Sequence[tuple[str, Any]]:
    """Views into ``flat`` (a uint8 tensor) as ``(name, tensor)`` pairs: no copy. The
    views are made on first use: a planned load (``polyrl.rollout.load_plan``) reads
    ``flat`` at the offsets it learned and never asks for them."""
    return _Unpacked(flat, metas)


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


# ------------------------------------------------------------ a bucket in a shared file
SHM_DIR = "/dev/shm"


@contextlib.contextmanager
def shared_file(bucket: Sequence[tuple[str, Any]]) -> Iterator[tuple[str, list[TensorMeta], int]]:
    """``bucket`` packed (:func:`pack_flat`'s layout, one copy) into a new file that
    processes of this node map without a copy (:func:`map_shared`); yields ``(path,
    metas, nbytes)`` and deletes the file on exit (a mapping made meanwhile stays valid).
    The file is in ``/dev/shm`` where the space can be reserved there, else in the temp
    dir (the page cache): reserved first, so a full tmpfs is an error here, not a
    SIGBUS in the writer."""
    import torch

    tensors = [(name, to_torch(a)) for name, a in bucket]
    key, metas, nbytes = _layout(tensors)
    path = _reserved(nbytes)
    try:
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        _copy_in(flat, key, metas, tensors, cache=False)
        del flat  # this process's mapping
        yield path, metas, nbytes
    finally:
        os.unlink(path)


def _reserved(nbytes: int) -> str:
    """A new file of ``nbytes`` reserved bytes, in ``/dev/shm`` if it has room."""
    for directory in (SHM_DIR, tempfile.gettempdir()):
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, f"polyrl-bucket-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return path
        except OSError:  # no room (ENOSPC), or a filesystem that cannot reserve
            os.unlink(path)
        finally:
            os.close(fd)
    raise OSError(
        f"no room for a {nbytes / 2**20:.0f} MiB weight bucket in {SHM_DIR} or "
        f"{tempfile.gettempdir()}: free space there or lower RunConfig.weight_bucket_mb"
    )


def map_shared(path: str, metas: Sequence[TensorMeta], nbytes: int) -> Sequence[tuple[str, Any]]:
    """The bucket :func:`shared_file` wrote at ``path`` as ``(name, tensor)`` views
    (:func:`unpack_flat`) of a private mapping of the file: no copy."""
    import torch

    flat = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    return unpack_flat(flat, metas)
