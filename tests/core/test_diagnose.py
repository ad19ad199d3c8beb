"""``polyrl diagnose``'s reading of a run directory, on a hand-made run: which backend it
takes as the training side of a step (the engines' part runs in
tests/trainer/test_shadow_check.py)."""

from __future__ import annotations

import json

from polyrl.configure.diagnose import saved_step
from polyrl.configure.launch import parse_config
from polyrl.observe import shadow


def test_sides_are_the_steps_not_the_resumed_runs(tmp_path):
    """Trained on torch to step 1, then resumed on JAX: the run's operative config now
    says jax_pjit, but step 2 was scored by torch (its shadow record says so); diagnose
    must replay it with torch as the training side, or it blames the wrong stack."""
    run = tmp_path / "run"
    _, operative = parse_config(
        ["gin/experiments/tiny_grpo.gin"], ["polyrl.RunConfig.backend = 'jax_pjit'"]
    )
    run.mkdir()
    (run / "operative_config.gin").write_text(operative)
    shadow.write_report(run / "shadow" / "step_2.json", 2, {}, [], shadow.sides("torch_fsdp"), None)
    (run / "shadow" / "step_2_batch.npz").touch()  # read by the engines' part only
    ckpt = run / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"backend": "torch_fsdp"}))

    saved = saved_step(run, 2)
    assert saved.cfg.backend == "jax_pjit"  # the run's config, as resumed
    assert saved.sides == {"train": "torch_fsdp", "shadow": "jax_pjit"}
    assert (saved.ckpt, saved.ckpt_backend) == (ckpt, "torch_fsdp")
