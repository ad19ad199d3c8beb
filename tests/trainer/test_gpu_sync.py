"""Weight sync on GPU placements, end to end (`polyrl train` on the tiny model; 2 GPUs):
CUDA IPC from every rank of a 2-rank FSDP actor to the server on its own GPU (and from
the one JAX host worker over both GPUs to the servers on each), and the
NCCL broadcast group of a disaggregated run (rollout on GPU 1, trainer on GPU 0, with the
asynchronous mode). Each step's `rollout/log_prob_diff_mean` (|trainer - rollout| log-probs
of the sampled tokens) shows the servers hold the trainer's weights: a server left on old
weights would differ by the size of an update.

Run on a GPU host: `pytest -m gpu tests/trainer/test_gpu_sync.py` (passed on 2 x H200,
2026-11-30: 114 s, 58 s and 63 s; `test_tensor_parallel_server_over_both_gpus`, both
backends, 2026-12-01: 200 s).
"""

from __future__ import annotations

import pytest

from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

pytestmark = pytest.mark.gpu
GRPO = "gin/experiments/tiny_grpo.gin"
# vLLM's GPU kernels against the trainer's, fp32 tiny model: 5e-3 absolute per token
# (tests/rollout/test_gpu_transports.py measured max 2.3e-3); a stale server is off by
# ~1e-2 or more per update at lr 3e-3 (tests/trainer/test_async.py, CPU).
SYNCED = 5e-3


def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.fixture
def ray_gpu():
    import ray
    import torch

    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tmp_path, *params):
    run = tmp_path / "run"
    train(
        [GRPO],
        [
            f"polyrl.RunConfig.run_dir = {str(run)!r}",
            "polyrl.RunConfig.tensorboard = False",
            "polyrl.RunConfig.total_steps = 4",
            "polyrl.RolloutConfig.gpu_memory_utilization = 0.2",
            "polyrl.RolloutConfig.enforce_eager = True",  # a tiny model: skip graph capture
            *params,
        ],
    )
    return read_jsonl(run / "metrics.jsonl")


def _synced_run(tmp_path, backend: str, *params):
    """A run of ``backend`` on both GPUs whose every step's servers hold the trainer's
    weights (the log-prob gap under SYNCED); its metrics rows."""
    _two_gpus()
    rows = _run(tmp_path, f"polyrl.RunConfig.backend = {backend!r}", *params)
    assert all(r["rollout/log_prob_diff_mean"] < SYNCED for r in rows), rows
    return rows


# every role in one pool of both GPUs, the actor sharded over them
COLOCATED = (
    'polyrl.RunConfig.pools = {"gpu": {"CPU": 8, "GPU": 2}}',
    'actor/polyrl.RoleConfig.pool = "gpu"',
    'reference/polyrl.RoleConfig.pool = "gpu"',
    'polyrl.RolloutConfig.pool = "gpu"',
    'actor/polyrl.ParallelConfig.mesh = {"fsdp": 2}',
)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_cuda_ipc_from_every_rank(ray_gpu, tmp_path, backend):
    """torch: each of the two ranks pushes to the server on its GPU; JAX: the one host
    worker drives both GPUs and pushes to both servers (a copy of each bucket per GPU)."""
    rows = _synced_run(
        tmp_path,
        backend,
        *COLOCATED,
        "polyrl.RunConfig.weight_transport = 'cuda_ipc'",
        "polyrl.RolloutConfig.num_servers = 2",
    )
    assert all(r["rollout/staleness_max"] == 0 for r in rows)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_tensor_parallel_server_over_both_gpus(ray_gpu, tmp_path, backend):
    """One rollout server with tensor_parallel_size=2 over the two GPUs the actor trains on
    (through the object store: CUDA IPC needs servers of one GPU each); each of the server's
    two workers loads its shard of every push."""
    rows = _synced_run(
        tmp_path,
        backend,
        *COLOCATED,
        "polyrl.RunConfig.weight_transport = 'object_store'",
        "polyrl.RolloutConfig.tensor_parallel_size = 2",
    )
    assert all(r["sync/gb"] > 0 for r in rows)


DISAGGREGATED = (
    'polyrl.RunConfig.pools = {"train": {"CPU": 4, "GPU": 1}, "gen": {"CPU": 4, "GPU": 1}}',
    'actor/polyrl.RoleConfig.pool = "train"',
    'reference/polyrl.RoleConfig.pool = "train"',
    'polyrl.RolloutConfig.pool = "gen"',
    "polyrl.RunConfig.weight_transport = 'nccl'",
)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_nccl_group_disaggregated(ray_gpu, tmp_path, backend):
    rows = _synced_run(tmp_path, backend, *DISAGGREGATED)
    assert all(r["sync/gb"] > 0 for r in rows)


def test_async_mode_on_two_gpus(ray_gpu, tmp_path):
    """Rollout on GPU 1 generates step k+1 while GPU 0 trains step k: staleness 1 after
    the first step; step 0's samples are the trainer's own weights."""
    _two_gpus()
    rows = _run(tmp_path, *DISAGGREGATED, "polyrl.RunConfig.async_rollout = True")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert rows[0]["rollout/log_prob_diff_mean"] < SYNCED
    assert all("async/generate_s" in r for r in rows[:-1])
