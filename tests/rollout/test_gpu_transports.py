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


def _pool(model_dir, num_gpus: float, num_servers: int = 1) -> RolloutPool:
    return RolloutPool(
        RolloutConfig(
            model_path=str(model_dir),
            num_servers=num_servers,
            dtype="float32",
            max_model_len=256,
            num_gpus=num_gpus,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
        )
    )


def _trainer_gpu(pool) -> torch.device:
    """Make a GPU no server uses this process's device (the trainer's rank 0): two NCCL
    ranks on one device are invalid."""
    used = {info["device_uuid"] for info in pool.infos}
    other = next(
        i
        for i in range(torch.cuda.device_count())
        if str(torch.cuda.get_device_properties(i).uuid) not in used
    )
    torch.cuda.set_device(other)
    return torch.device("cuda", other)


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


def test_cuda_ipc_planned_load_matches_load_weights(gpu_ray, padded_model_dir):
    """The load plan (polyrl.rollout.load_plan) against vLLM's load_weights on the GPU
    build: the same pushes give the same parameters (stacked qkv / gate_up, tied
    embedding), the pushes after the first are planned, and generation is right."""
    import ray

    pool = _pool(padded_model_dir, num_gpus=0.4)
    server = pool.servers[0]
    device = torch.device("cuda", 0)
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.1.mlp.gate_up_proj.weight",
        "model.norm.weight",
    ]

    def push(model, planned: bool) -> list[float]:
        ray.get(server.set_load_plan.remote(planned))
        pool.update_weights(
            iter_buckets(model.state_dict().items(), 64 * 1024), transport="cuda_ipc"
        )
        return ray.get([server.param_checksum.remote(n) for n in names])

    a = load_hf(padded_model_dir, seed=7).to(device)
    b = load_hf(padded_model_dir, seed=8).to(device)
    want_a, want_b = push(a, False), push(b, False)
    assert want_a != want_b
    assert push(a, True) == want_a  # learns: load_weights under the recorder
    assert push(b, True) == want_b  # planned copies from here on
    assert push(a, True) == want_a
    stats = ray.get(server.load_plan_stats.remote())[0]
    assert stats["learned"] > 0 and stats["planned"] == 2 * stats["learned"]
    assert stats["graphed"] == stats["planned"]  # the IPC buffer stays: CUDA graph replays
    assert stats["refused"] == 0 and stats["fallback_tensors"] == 0
    _check(pool, a, device)
    pool.shutdown()


def test_nccl_disaggregated(gpu_ray, padded_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the server on one, the trainer on the other")
    pool = _pool(padded_model_dir, num_gpus=1)
    device = _trainer_gpu(pool)
    model = load_hf(padded_model_dir, seed=6).to(device)
    syncer = pool.weight_syncer("nccl")
    assert syncer.ensure_group()  # this process (rank 0, NCCL on its GPU) + 1 server worker
    pool.commit(syncer.push(iter_buckets(model.state_dict().items(), 64 * 1024), pool.version + 1))
    assert pool.weight_versions() == [1]
    _check(pool, model, device)
    pool.shutdown()


def test_nccl_server_killed_during_push_is_resynced(gpu_ray, padded_model_dir):
    """docs/reliability.md: server 0 dies after the 3rd bucket of an NCCL group push. The
    trainer's broadcast fails within group_timeout_s (NCCL does not see the peer go), the
    group is aborted and formed again with server 1, the push completes there; commit()
    re-syncs the restarted server 0 and the next push reaches both over a new group."""
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs: two servers and the trainer")
    import ray

    pool = _pool(padded_model_dir, num_gpus=1, num_servers=2)
    device = _trainer_gpu(pool)
    model = load_hf(padded_model_dir, seed=7).to(device)
    syncer = pool.weight_syncer("nccl")
    syncer.group_timeout_s = 30.0
    assert syncer.ensure_group()
    pool.resync_source = lambda: iter_buckets(model.state_dict().items(), 64 * 1024)

    def buckets():
        for i, bucket in enumerate(iter_buckets(model.state_dict().items(), 16 * 1024)):
            if i == 3:
                ray.kill(pool.servers[0], no_restart=False)
            yield bucket

    stats = syncer.push(buckets(), pool.version + 1)
    assert stats.lost == [0]
    pool.commit(stats)
    assert pool.weight_versions() == [stats.version] * 2
    _check(pool, model, device)
    assert syncer.ensure_group()  # again with the restarted server
    model2 = load_hf(padded_model_dir, seed=8).to(device)
    pool.commit(syncer.push(iter_buckets(model2.state_dict().items(), 64 * 1024), pool.version + 1))
    assert pool.weight_versions() == [pool.version] * 2
    _check(pool, model2, device)
    pool.shutdown()
