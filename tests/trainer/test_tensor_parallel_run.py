"""The tiny GRPO through the trainer with the torch actor split over 2 tensor-parallel
ranks (gloo on CPU) gives the numbers of the 1-rank actor.

Both runs sample the same rollouts at step 1 (same weights, seeded sampling), so the
step's reward is identical and the actor's loss, KL and gradient norm agree to the
engine-level tensor-parallel tolerance (tests/backends/torch_fsdp/test_tensor_parallel.py);
later steps sample from weights that differ by ~1e-7, so only a finite loss is checked
(measured: all 3 steps gave the same rewards, losses within 2e-8, grad norms within 2e-7).
Two runs of 3 steps: ~80 s on the 2-core box, hence slow.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

GRPO = "gin/experiments/tiny_grpo.gin"
STEPS = 3


def _run(run_dir, *extra: str) -> list[dict]:
    train(
        [GRPO],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.tensorboard = False",
            f"polyrl.RunConfig.total_steps = {STEPS}",
            *extra,
        ],
    )
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_grpo_with_a_tensor_parallel_actor_equals_one_rank(ray_session, tmp_path):
    one = _run(tmp_path / "one")
    tp = _run(tmp_path / "tp", "actor/polyrl.ParallelConfig.mesh = {'tensor': 2}")
    assert [r["step"] for r in tp] == list(range(1, STEPS + 1))
    assert tp[0]["reward/mean"] == one[0]["reward/mean"]
    for key in ("actor/loss", "actor/grad_norm", "actor/kl_loss"):
        assert tp[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-7), key
    for row in tp:
        assert np.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0
