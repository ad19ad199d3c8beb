"""Validation during training (polyrl.loop.evaluation) on the tiny model: real vLLM, real Ray.

The run with validation must log val/ metrics at the configured steps and take exactly
the training steps of the run without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.configure.launch import parse_config, train
from polyrl.configure.validate import check_run
from polyrl.loop.metrics import read_jsonl

GRPO = "gin/experiments/tiny_grpo.gin"
GRPO_VAL = "gin/experiments/tiny_grpo_val.gin"  # the demo: GRPO + validation


def _run(gin_file: str, run_dir: Path, *extra: str) -> list[dict]:
    train(
        [gin_file],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.total_steps = 3",
            *extra,
        ],
    )
    return read_jsonl(run_dir / "metrics.jsonl")


def _training(row: dict) -> dict:
    # time/*, startup/* and sync/seconds are wall-clock readings, different in any two runs.
    skip = ("val/", "time/", "startup/", "sync/seconds")
    return {k: v for k, v in row.items() if not k.startswith(skip)}


# slow: two runs; the default tier validates in test_multiturn.py's run
@pytest.mark.slow
def test_validation_logs_val_metrics_and_leaves_training_unchanged(ray_session, tmp_path):
    plain = _run(GRPO, tmp_path / "plain", "polyrl.RunConfig.tensorboard = False")
    val = _run(
        GRPO_VAL,
        tmp_path / "val",
        "polyrl.RunConfig.eval_every = 2",
        "polyrl.RunConfig.n_val_prompts = 12",
        "val/polyrl.SamplingSpec.n = 4",
        "val/polyrl.SamplingSpec.temperature = 1.0",
    )
    # row N is the state after N steps: the initial weights (row 0), after step 2 (every
    # 2), and the final weights after step 3
    assert [r["step"] for r in val] == [0, 1, 2, 3]
    has_val = [r["step"] for r in val if "val/reward/mean" in r]
    assert has_val == [0, 2, 3]
    final = val[-1]
    assert "time/step" not in val[0] and "reward/mean" not in val[0]
    for key in ("val/polyrl/copy/pass@1", "val/polyrl/copy/pass@2", "val/polyrl/copy/pass@4"):
        assert key in val[0] and key in final
    assert 0.0 <= final["val/polyrl/copy/pass@1"] <= final["val/polyrl/copy/pass@4"] <= 1.0
    assert final["val/polyrl/copy/reward/mean@4"] == pytest.approx(final["val/reward/mean"])
    # Same seeds, same data order, same weights: the training numbers are identical
    # (fp32 CPU kernels in one Ray session are deterministic; no tolerance needed).
    assert [_training(r) for r in val[1:]] == [_training(r) for r in plain]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "val" / "tensorboard"))
    events.Reload()
    logged = events.Scalars("val/polyrl/copy/pass@1")
    assert [e.step for e in logged] == [0, 2, 3]
    assert logged[-1].value == pytest.approx(final["val/polyrl/copy/pass@1"])

    samples = [json.loads(x) for x in (tmp_path / "val" / "val_samples" / "step_3.jsonl").open()]
    assert len(samples) == 8
    assert samples[0]["data_source"] == "polyrl/copy" and samples[0]["prompt"].count("copy")
    assert (tmp_path / "val" / "val_samples" / "step_0.jsonl").exists()
    assert not (tmp_path / "plain" / "val_samples").exists()


def test_validation_config_problems_name_the_binding(tmp_path):
    from polyrl.algos import get_algorithm

    run = f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"
    cfg, _ = parse_config([GRPO], [run, "polyrl.RunConfig.eval_every = 5"])
    problems = check_run(cfg, get_algorithm("grpo"), cluster=False)
    assert any("RunConfig.eval_every=5 but there is no validation data" in p for p in problems)
    cfg, _ = parse_config(
        [GRPO],
        [
            run,
            "polyrl.RunConfig.eval_every = 5",
            "polyrl.RunConfig.n_val_prompts = 8",
            "val/polyrl.SamplingSpec.n = 4",
        ],
    )
    problems = check_run(cfg, get_algorithm("grpo"), cluster=False)
    assert any("val/SamplingSpec.n=4 with temperature 0" in p for p in problems), problems
    cfg, _ = parse_config(
        ["gin/experiments/tiny_dpo.gin"], [run, "polyrl.RunConfig.eval_every = 5"]
    )
    problems = check_run(cfg, get_algorithm("dpo"), cluster=False)
    assert any("RunConfig.eval_every=5: validation generates" in p for p in problems), problems
