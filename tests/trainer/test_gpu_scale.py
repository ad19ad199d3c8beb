"""One role over every GPU of a node (needs 2 GPUs; ``pytest -m gpu tests/trainer/test_gpu_scale.py``).

Never run where they were written (no GPU there): these are the proof that the process
models place a role over both GPUs. The tiny GRPO runs two steps with every role in one
pool of 2 GPUs: the JAX actor is ONE Ray worker whose mesh spans both GPUs (make_mesh
refuses to start if it sees fewer devices than the mesh needs), the torch actor is two
ranks, each on its own GPU, under FSDP and under tensor parallelism.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polyrl.configure.launch import _components, parse_config, prepare

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run(run_dir: Path, backend: str, mesh: dict) -> tuple[list[dict], dict]:
    from polyrl.loop.trainer import RLTrainer

    cfg, _ = parse_config(
        ["gin/experiments/tiny_grpo.gin"],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            f"polyrl.RunConfig.backend = {backend!r}",
            "polyrl.RunConfig.tensorboard = False",
            "polyrl.RunConfig.total_steps = 2",
            "polyrl.RunConfig.offload_colocated = False",
            "polyrl.RunConfig.pools = {'gpu': {'CPU': 4, 'GPU': 2}}",
            "actor/polyrl.RoleConfig.pool = 'gpu'",
            "reference/polyrl.RoleConfig.pool = 'gpu'",
            "polyrl.RolloutConfig.pool = 'gpu'",
            "polyrl.RolloutConfig.gpu_memory_utilization = 0.2",
            f"actor/polyrl.ParallelConfig.mesh = {mesh!r}",
        ],
    )
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        where = trainer.actor.where()
        last = trainer.run()
    finally:
        trainer.shutdown()
    return where, last


def test_jax_actor_over_both_gpus(gpu_ray, tmp_path):
    where, last = _run(tmp_path, "jax_pjit", {"fsdp": 2})
    assert len(where) == 1  # one host worker drives the whole mesh
    assert len(where[0]["gpus"].split(",")) == 2, where
    assert np.isfinite(last["actor/loss"]) and last["step"] == 2


def test_torch_fsdp_over_both_gpus(gpu_ray, tmp_path):
    where, last = _run(tmp_path, "torch_fsdp", {"fsdp": 2})
    assert len(where) == 2  # a rank per GPU, each on a different one
    assert sorted(w["gpus"] for w in where) == sorted({w["gpus"] for w in where}), where
    assert all(len(w["gpus"].split(",")) == 1 for w in where), where
    assert np.isfinite(last["actor/loss"]) and last["step"] == 2


def test_torch_tensor_parallel_over_both_gpus(gpu_ray, tmp_path):
    """The torch actor split over both GPUs by tensor parallelism (NCCL), two GRPO steps."""
    where, last = _run(tmp_path, "torch_fsdp", {"tensor": 2})
    assert len(where) == 2 and len({w["gpus"] for w in where}) == 2, where
    assert np.isfinite(last["actor/loss"]) and last["step"] == 2
