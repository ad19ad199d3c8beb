"""`polyrl report RUN_DIR` on a run directory written by the run's own writers (the
tracker, checkpoints.save, the shadow check's report): health warnings, checkpoints,
resumes, staleness and the shadow check, beside the curves and phase times."""

from __future__ import annotations

import os

from polyrl import checkpoints
from polyrl.cli import main
from polyrl.loop.metrics import Tracker
from polyrl.observe import shadow

GAPS = ("rollout_train", "rollout_shadow", "train_shadow")


def _write_run(run_dir) -> None:
    """Six steps of an async run (max_staleness 2) with the shadow check at steps 1 and
    5, checkpoints every 2 steps (two kept), killed after step 5 and resumed from step 4;
    the rewards were identical at steps 2 and 3 (the health check fired)."""

    def row(step: int) -> dict[str, float]:
        out = {
            "reward/mean": 0.1 * step,
            "time/step": 1.0,
            "time/generate": 0.5,
            "health/rewards_identical": float(step in (2, 3)),
            "health/phase_slow": 0.0,
            "async/wait_s": 0.1,
            "rollout/staleness_mean": 0.5 * (step > 1),
            "rollout/staleness_max": float(step > 1) + (step == 3),
            "rollout/stale_rows": float(step == 3) * 3,
            "rollout/stale_dropped": float(step == 3),
        }
        return out | ({"startup/total_s": 9.0} if step in (1, 5) else {})

    def save(step: int) -> None:
        parts = {"actor": os.makedirs}  # an engine writes its part into the directory
        checkpoints.save(run_dir, step, parts, {}, {"backend": "torch_fsdp"}, keep=2)

    t = Tracker(run_dir, tensorboard=False)
    for step in range(1, 6):
        t.log(step, row(step))
        if step % 2 == 0:
            save(step)
    t.close()
    t = Tracker(run_dir, tensorboard=False, resume_step=4)
    for step in range(5, 7):
        t.log(step, row(step))
    save(6)
    t.close()
    sides = {"rollout": "vLLM", "train": "torch_fsdp", "shadow": "jax_pjit"}
    for step, gaps, verdict in ((1, (0.01, 0.01, 0.002), None), (5, (0.3, 0.008, 0.3), "train")):
        metrics = {f"shadow/gap_mean/{p}": g for p, g in zip(GAPS, gaps)}
        path = run_dir / "shadow" / f"step_{step}.json"
        shadow.write_report(path, step, metrics, [], sides, verdict)


def test_report_shows_health_checkpoints_resumes_staleness_and_the_shadow_check(tmp_path, capsys):
    """Issue 47: the report left all of these out."""
    _write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"run {tmp_path}: 6 steps" in lines
    assert (
        "health: rewards_identical at steps 2-3 (what to check: docs/debugging.md "
        '"Health warnings")'
    ) in lines
    assert f"checkpoints: step_4, step_6 in {tmp_path / 'checkpoints'}" in lines
    assert "resumes: 1, from the checkpoint of step 4 (dotted lines in summary.png)" in lines
    # staleness over 6 steps: mean (0 + 5 x 0.5) / 6, max 2 at step 3
    assert (
        "staleness (policy versions): mean 0.42, max 2; 3 rows beyond the bound, 1 dropped"
    ) in lines
    assert (
        "shadow check: 2 checks (steps 1, 5); largest mean gaps per token: rollout-train "
        "0.3 (step 5), rollout-shadow 0.01 (step 1), train-shadow 0.3 (step 5)"
    ) in lines
    assert (
        f"  step 5: the train side (torch_fsdp) disagrees with the two others: "
        f"{tmp_path / 'shadow' / 'step_5.json'}, polyrl diagnose {tmp_path} --step 5"
    ) in lines


def test_report_says_what_a_plain_run_did_not_have(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "time/step": 1.0}\n')
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [ln for ln in lines if ln.startswith("health")]  # no health/*: none checked
    assert "checkpoints: none" in lines
    assert "resumes: none" in lines
    assert not [ln for ln in lines if ln.startswith(("staleness", "shadow check"))]
