"""The JAX backend's GPU memory pool (backends/jax_pjit/gpu_memory.py): kept while the
engine is resident, handed back to the GPU by offload(). Read from the CUDA driver's own
pool counters."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends.jax_pjit import gpu_memory  # noqa: E402
from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

GIB = 2**30


def _gpu() -> jax.Device:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs a CUDA GPU visible to JAX (JAX_PLATFORMS=cuda,cpu)")
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    assert allocator == "cuda_async", (
        f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator!r} in this test run: these tests check the "
        "backend's default (cuda_async); unset it"
    )
    return gpus[0]


def _unused(device) -> int:
    reserved, used = gpu_memory.pool_bytes(device)
    return reserved - used


def test_pooled_only_under_cuda_async(monkeypatch):
    cpu = jax.devices("cpu")[0]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert gpu_memory.pooled([cpu]) == []
    gpu_memory.keep([cpu])  # no GPU: nothing to do and no driver call (CI has no libcuda)
    gpu_memory.release([cpu])


@pytest.mark.gpu
def test_pool_keeps_freed_memory_until_released():
    gpu = _gpu()
    gpu_memory.keep([gpu])
    x = jax.device_put(jnp.ones((GIB // 4,), jnp.float32), gpu)  # 1 GiB
    jax.block_until_ready(x)
    x.delete()
    jax.block_until_ready(jax.device_put(jnp.zeros(()), gpu) + 0)
    assert _unused(gpu) >= GIB  # the freed GiB stays in the pool
    gpu_memory.release([gpu])
    assert _unused(gpu) < 64 * 2**20


@pytest.mark.gpu
def test_offload_hands_the_pool_back(tiny_model_dir):
    gpu = _gpu()
    eng = JaxPjitEngine(devices=[gpu])
    eng.init(
        ModelConfig(str(tiny_model_dir)), OptimConfig(lr=1e-3), ParallelConfig(micro_batch_size=2)
    )
    batch = from_token_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, pad_id=0)
    ones = np.ones((4, 4), np.float32)
    batch = batch.with_columns(
        {"advantages": ones, "old_log_probs": -4 * ones, "ref_log_probs": -4 * ones}
    )
    eng.train_step(batch, get_algorithm("grpo").make_actor_loss())
    held = gpu_memory.pool_bytes(gpu)[1]
    big = jax.device_put(jnp.ones((GIB // 4,), jnp.float32), gpu)
    jax.block_until_ready(big)
    big.delete()  # the pool now holds at least 1 GiB unused
    eng.offload()
    assert _unused(gpu) < 64 * 2**20
    assert gpu_memory.pool_bytes(gpu)[1] < held  # params and optimizer state left the GPU
    eng.reload()
    assert np.isfinite(eng.forward(batch)["log_probs"]).all()
