"""GPU weight transports (CUDA IPC, NCCL) against transformers on the same GPU.

Never run where they were written (no GPU there): these are the proof they work, to be
run on a GPU host with the GPU vLLM build (``pytest -m gpu tests/rollout``).

Tolerance: vLLM's GPU kernels (FlashAttention, cuBLAS with TF32 allowed) against
transformers' fp32 reference on the CPU: 5e-3 absolute on log-probs of the 2-layer fp32
model. Measured on an H200: max 2.3e-3 (1 of 32 values above 2e-3, the first guess). A
stale or wrong weight moves these log-probs by more than 0.1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_reference import hf_log_probs, load_hf, prompts_batch

from polyrl.rollout import RolloutConfig, RolloutPool, SamplingSpec
from polyrl.weight_sync import iter_buckets

pytestmark = pytest.mark.gpu
GPU_ATOL = 5e-3  # see module docstring


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _pool(model_dir, num_gpus: float) -> RolloutPool:
    return RolloutPool(
        RolloutConfig(
            model_path=str(model_dir),
            dtype="float32",
            max_model_len=256,
            num_gpus=num_gpus,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
        )
    )


def _check(pool, model, device) -> None:
    out = pool.generate(
        prompts_batch([6, 40], seed=2), SamplingSpec(n=2, temperature=0.9, max_tokens=8, seed=4)
    )
    ref = hf_log_probs(model.cpu(), out, temperature=0.9, vocab=pool.sampling_vocab_size)
    np.testing.assert_allclose(out["rollout_log_probs"], ref, atol=GPU_ATOL, rtol=0)
    model.to(device)


def test_cuda_ipc_colocated(gpu_ray, padded_model_dir):
    # 0.4 GPU: the server and this process (the "trainer") share GPU 0.
    pool = _pool(padded_model_dir, num_gpus=0.4)
    device = torch.device("cuda", 0)
    model = load_hf(padded_model_dir, seed=5).to(device)
    stats = pool.update_weights(
        iter_buckets(model.state_dict().items(), 64 * 1024), transport="cuda_ipc"
    )
    assert stats.retained is None and pool.weight_versions() == [1]
    _check(pool, model, device)
    pool.shutdown()


def test_nccl_disaggregated(gpu_ray, padded_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the server on one, the trainer on the other")
    pool = _pool(padded_model_dir, num_gpus=1)
    # The trainer side must sit on the other GPU (two NCCL ranks on one device are invalid).
    server_uuid = pool.infos[0]["device_uuid"]
    other = next(
        i
        for i in range(torch.cuda.device_count())
        if str(torch.cuda.get_device_properties(i).uuid) != server_uuid
    )
    torch.cuda.set_device(other)
    device = torch.device("cuda", other)
    model = load_hf(padded_model_dir, seed=6).to(device)
    syncer = pool.weight_syncer("nccl")
    assert syncer.ensure_group()  # this process (rank 0, NCCL on its GPU) + 1 server worker
    pool.commit(syncer.push(iter_buckets(model.state_dict().items(), 64 * 1024), pool.version + 1))
    assert pool.weight_versions() == [1]
    _check(pool, model, device)
    pool.shutdown()
