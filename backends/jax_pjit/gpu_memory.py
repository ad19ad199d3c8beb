"""The JAX backend's GPU memory pool: kept while the engine is resident, handed back to
the GPU when it offloads (docs/backends.md "GPU memory").

The backend runs XLA on CUDA's stream-ordered allocator (``XLA_PYTHON_CLIENT_ALLOCATOR=
cuda_async``, set by this package): a buffer is freed in stream order, with no device-wide
synchronisation, into the device's default memory pool. XLA leaves that pool's release
threshold at 0, so every host synchronisation hands the freed memory back to the driver
and the next step maps it again: on the 1.5B training step that was 0.478 s a step against
0.316 s with a pool that keeps its memory (docs/performance.md). :func:`keep` raises the
threshold, so the pool keeps what it took, as torch's caching allocator does; :func:`release`
trims it to what is in use, as ``torch.cuda.empty_cache()`` does, after ``offload()``.

Both act on the devices' default pools through the CUDA driver (``libcuda``), and do nothing
under another allocator (``platform`` or ``bfc`` set by the user) or off GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable

import jax
import jax.numpy as jnp

__all__ = ["keep", "release", "pooled", "pool_bytes"]

# CUmemPool_attribute: CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, _RESERVED_MEM_CURRENT, _USED_MEM_CURRENT
_RELEASE_THRESHOLD, _RESERVED, _USED = 4, 5, 7
_KEEP_ALL = ctypes.c_uint64(2**64 - 1)


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def pooled(devices: Iterable[jax.Device]) -> list[jax.Device]:
    """The GPUs among ``devices`` whose memory comes from CUDA's default pool (the
    ``cuda_async`` allocator)."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "cuda_async":
        return []
    return [d for d in devices if d.platform == "gpu"]


def _pool(device: jax.Device) -> ctypes.c_void_p:
    cuda, handle, pool = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(handle), device.local_hardware_id), "cuDeviceGet")
    _check(cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), handle), "cuDeviceGetDefaultMemPool")
    return pool


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {code}")


def keep(devices: Iterable[jax.Device]) -> None:
    """Let the devices' pools keep freed memory for the next allocation."""
    for d in pooled(devices):
        _check(
            _driver().cuMemPoolSetAttribute(_pool(d), _RELEASE_THRESHOLD, ctypes.byref(_KEEP_ALL)),
            "cuMemPoolSetAttribute",
        )


def release(devices: Iterable[jax.Device]) -> None:
    """Hand the pools' unused memory back to the GPU. Call it after deleting arrays: a
    computation on each device waits for the frees queued before it, then the pool is
    trimmed to the memory still in use."""
    for d in pooled(devices):
        jax.block_until_ready(jax.device_put(jnp.zeros(()), d) + 0)
        _check(_driver().cuMemPoolTrimTo(_pool(d), ctypes.c_size_t(0)), "cuMemPoolTrimTo")


def pool_bytes(device: jax.Device) -> tuple[int, int]:
    """(bytes the device's default pool holds, bytes of it in use)."""
    out = []
    for attribute in (_RESERVED, _USED):
        value = ctypes.c_uint64()
        _check(
            _driver().cuMemPoolGetAttribute(_pool(device), attribute, ctypes.byref(value)),
            "cuMemPoolGetAttribute",
        )
        out.append(value.value)
    return out[0], out[1]
