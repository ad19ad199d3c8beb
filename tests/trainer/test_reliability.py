"""Faults during real runs (tiny model, real Ray and vLLM), injected by ``polyrl.faults``:
a driver killed while it writes a checkpoint, non-finite steps, a dead training worker,
failed writes. docs/reliability.md lists the outcomes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl import faults
from polyrl.checkpoints import CheckpointMismatch
from polyrl.launch import train
from polyrl.metrics import read_jsonl
from polyrl.reliability import RunStopped

ROOT = Path(__file__).resolve().parents[2]
GIN = {
    "torch_fsdp": "gin/experiments/tiny_grpo.gin",
    "jax_pjit": "gin/experiments/tiny_grpo_jax.gin",
}
KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl_loss")


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


@pytest.mark.parametrize(
    "backend", ["jax_pjit", pytest.param("torch_fsdp", marks=pytest.mark.slow)]
)
def test_kill_during_checkpoint_save_then_resume(backend, ray_session, tmp_path):
    """The driver is SIGKILLed while it writes the step-4 checkpoint (after all 4 steps
    were logged: those rows are the uninterrupted run's). The partial step_4.tmp is
    ignored, --resume restarts from step_2 and steps 2 and 3 come out equal; the next
    save removes the partial directory."""
    run = tmp_path / "run"
    common = _params(run, "polyrl.RunConfig.total_steps = 4", "polyrl.RunConfig.save_every = 2")
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", GIN[backend]]
    cmd += [a for p in common for a in ("--gin_param", p)]
    env = {**os.environ, faults.ENV: "kill_in_save@4", "RAY_ADDRESS": "local"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.wait(timeout=600) == -signal.SIGKILL
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the killed driver's own Ray processes
    uninterrupted = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4]  # row N: after N steps
    assert (run / "checkpoints" / "step_4.tmp" / "actor").is_dir()
    assert not (run / "checkpoints" / "step_4.tmp" / "trainer_state.json").exists()

    train([GIN[backend]], common, resume=True)
    resumed = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # no step skipped or repeated
    for a, b in zip(uninterrupted, resumed):
        for key in KEYS:
            # Same seeds, data order and optimizer state, fp32 CPU kernels: equal up to
            # reduction-order noise of a restarted process.
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]  # the partial directory is gone

    other = "torch_fsdp" if backend == "jax_pjit" else "jax_pjit"
    with pytest.raises(
        CheckpointMismatch, match=f"backend: checkpoint '{backend}', this run '{other}'"
    ):
        train([GIN[other]], common, resume=True)


@pytest.mark.slow  # the engines' skip is in the default tier (tests/backends/test_contract.py)
def test_nonfinite_steps_are_skipped_then_stop_the_run(ray_session, tmp_path, monkeypatch, capsys):
    """Each step takes 2 actor updates; updates 2-5 (steps 1 and 2) get a NaN loss.
    Both steps are skipped and reported; with max_nonfinite_steps = 2 the run stops after
    step 2 with a checkpoint and says why."""
    monkeypatch.setenv(faults.ENV, "nan_loss@actor=2,3,4,5")
    run = tmp_path / "run"
    params = _params(
        run, "polyrl.RunConfig.total_steps = 6", "polyrl.RunConfig.max_nonfinite_steps = 2"
    )
    with pytest.raises(RunStopped, match="2 consecutive steps had non-finite") as err:
        train([GIN["torch_fsdp"]], params)
    assert str(run / "checkpoints" / "step_3") in str(err.value) and "--resume" in str(err.value)
    out = capsys.readouterr().out
    assert "[nonfinite] step 1: actor update skipped" in out
    assert "[nonfinite] step 2: actor update skipped" in out and "step 0: actor" not in out
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "backend", ["torch_fsdp", pytest.param("jax_pjit", marks=pytest.mark.slow)]
)
def test_dead_training_worker_stops_the_run_and_resume_continues(
    backend, ray_session, tmp_path, monkeypatch
):
    """The actor's worker is SIGKILLed at the start of update 2 (step 1): the run stops
    at once, naming the role and how to resume, and --resume finishes the run."""
    monkeypatch.setenv(faults.ENV, "kill_worker@actor=2")
    run = tmp_path / "run"
    params = _params(run, "polyrl.RunConfig.total_steps = 2", "polyrl.RunConfig.save_every = 1")
    with pytest.raises(RunStopped, match=r"role 'actor' worker \(rank 0\) died") as err:
        train([GIN[backend]], params)
    assert str(run / "checkpoints" / "step_1") in str(err.value) and "--resume" in str(err.value)
    monkeypatch.delenv(faults.ENV)
    train([GIN[backend]], params, resume=True)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize(
    "target, at", [pytest.param("metrics", 2, marks=pytest.mark.slow), ("checkpoint", 2)]
)
def test_failed_write_stops_with_the_last_good_checkpoint(
    target, at, ray_session, tmp_path, monkeypatch
):
    """A full disk (ENOSPC, fault hook) when the second step's metrics row or the step-2
    checkpoint is written: the run stops naming the failure and step_1."""
    monkeypatch.setenv(faults.ENV, f"fail_write@{target}={at}")
    run = tmp_path / "run"
    params = _params(run, "polyrl.RunConfig.total_steps = 2", "polyrl.RunConfig.save_every = 1")
    with pytest.raises(RunStopped, match="No space left on device") as err:
        train([GIN["torch_fsdp"]], params)
    assert f"the last good checkpoint is {run / 'checkpoints' / 'step_1'}" in str(err.value)
