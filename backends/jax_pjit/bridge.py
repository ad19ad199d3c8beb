"""The JAX backend's array bridge for weight sync (``Backend.arrays`` in
``polyrl.backends.base``): jax arrays -> torch tensors and flat buckets, on device.

``polyrl.weight_sync.packing`` asks this module, through the registry, for what only
JAX knows: gathering a sharded array onto one device (:func:`on_one_device`, before
DLPack hands it to torch without a copy), which torch device an array sits on
(:func:`torch_device`), and packing a bucket of jax arrays into one flat uint8 torch
buffer with one jitted XLA program (:func:`pack`, :func:`pack_arrays`): JAX -> CUDA IPC
/ NCCL buckets never touch the host. The engine's export buckets
(``weights.ExportBucket``) pack themselves through :func:`pack_arrays` too.

torch is imported inside functions (the rollout side's tensors; vLLM is a torch program).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from polyrl.backends.buckets import TensorMeta, aligned

__all__ = ["on_one_device", "torch_device", "pack", "pack_arrays"]

_DLPACK_CUDA = 2  # DLPack's kDLCUDA device type


def _is_jax(x: Any) -> bool:
    return type(x).__module__.startswith("jax") and hasattr(x, "sharding")


def on_one_device(x: Any, device: Any = None):
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


def torch_device(x: Any):
    """The torch device of a jax array's (first) device."""
    import torch

    device = next(iter(x.sharding.device_set))
    return torch.device("cuda" if device.platform in ("gpu", "cuda") else "cpu")


def pack(bucket: Sequence[tuple[str, Any]], alloc: Any) -> tuple[Any, list[TensorMeta]] | None:
    """``polyrl.weight_sync.pack_flat`` for a bucket of jax arrays, each gathered onto the
    first array's first device; None (pack_flat's generic path) unless every array is a
    jax array whose shards are all on this process."""
    if not all(_is_jax(a) and a.is_fully_addressable for _, a in bucket):
        return None
    first = bucket[0][1].addressable_shards[0].device
    names = [name for name, _ in bucket]
    return pack_arrays(names, [on_one_device(a, first) for _, a in bucket], None, alloc)


def pack_arrays(names: Sequence[str], arrays: Sequence[Any], dtype: Any, alloc: Any):
    """Pack jax arrays on one device: one jitted program casts each to ``dtype`` (None:
    as it is) and writes its bytes, 256-byte aligned, into the uint8 tensor
    ``alloc(nbytes, device)`` (on the arrays' device).

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
        offset += aligned(nbytes)
    kind, ordinal = arrays[0].__dlpack_device__()
    device = torch.device("cuda", ordinal) if kind == _DLPACK_CUDA else torch.device("cpu")
    buffer = alloc(offset, device)[:offset]
    # 2-byte words when every size allows (bf16, fp32): XLA moves them far faster than bytes
    word = 2 if all(m[4] % 2 == 0 for m in metas) else 1
    words = buffer.view(torch.int16 if word == 2 else torch.uint8)
    # torch's stream waits for XLA's writes when it takes the result (DLPack's stream
    # handshake), so what torch runs next on the buffer (an IPC event, a broadcast) follows
    out = torch.from_dlpack(_packer(dtype, word)(jax.dlpack.from_dlpack(words), *arrays))
    if out.data_ptr() != buffer.data_ptr():
        words.copy_(out)
    return buffer, metas


@functools.cache
def _packer(dtype: Any, word: int = 1):
    """The program of :func:`pack_arrays`: (destination words, *arrays) -> the
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
            offset += aligned(b.size * word) // word
        return dest

    return jax.jit(pack_words, donate_argnums=0)
