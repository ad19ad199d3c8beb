"""RunConfig.profile_steps: the listed steps run every trainer role's worker (the actor
and the reference here) under its framework's profiler; each writes a trace of that
step's work and its top ops, and the run says where they are in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.configure.launch import train

GIN = {
    "torch_fsdp": "gin/experiments/tiny_grpo.gin",
    "jax_pjit": "gin/experiments/tiny_grpo_jax.gin",
}


@pytest.mark.parametrize(
    "backend",
    # one backend in the default tier: the profiler hooks are the worker's, not the backend's
    ["torch_fsdp", pytest.param("jax_pjit", marks=pytest.mark.slow)],
)
def test_profiled_step_traces_every_trainer_worker(ray_session, tmp_path, backend, capsys):
    run = tmp_path / backend
    params = [
        f"polyrl.RunConfig.run_dir = {str(run)!r}",
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.total_steps = 2",
        "polyrl.RunConfig.profile_steps = [2]",
    ]
    train([GIN[backend]], params)
    out = run / "profile" / "step_2"
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["step_2"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["actor_0", "reference_0"]
    for name, profile in summary.items():
        trace = Path(profile["trace"])
        assert trace.is_file() and out in trace.parents, (name, trace)
        assert profile["wall_s"] > 0 and profile["top"], (name, profile)
        ops = {op["name"] for op in profile["top"]}
        if backend == "torch_fsdp":  # the model's matmuls ran inside the recording
            assert ops & {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear"}, ops
        else:  # XLA's op spans on its CPU threads, timed
            assert sum(op["ms"] for op in profile["top"]) > 0, ops
    printed = capsys.readouterr().out
    assert f"[profile] step 2: actor_0, reference_0 traced in {out} (summary.json); actor_0: " in (
        printed
    )
    assert main(["report", str(run)]) == 0
    assert f"profile: {out} (actor_0, reference_0; top ops in summary.json)" in (
        capsys.readouterr().out.splitlines()
    )
