"""Run checkpoints on the real file system (polyrl/checkpoints.py) and the start-up checks
of the run dir (polyrl/cluster/reliability.py): atomic saves, partial saves ignored then removed,
manifest mismatches named, unwritable or full run dirs refused before any worker starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl import checkpoints, faults
from polyrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = {
    "format": 1,
    "backend": "torch_fsdp",
    "algorithm": "grpo",
    "trained_roles": ["actor"],
    "model": {"hidden_size": 32, "num_hidden_layers": 2},
}


def _writer(tag: str):
    def write(path: str) -> None:
        Path(path).mkdir(parents=True)
        Path(path, "weights.txt").write_text(tag)

    return write


def _save(run_dir: Path, step: int, keep: int = 2) -> Path:
    return checkpoints.save(
        run_dir, step, {"actor": _writer(f"w{step}")}, {"kl": step}, MANIFEST, keep
    )


def test_save_keeps_the_newest_and_restore_checks_and_loads(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]
    path = checkpoints.latest_checkpoint(tmp_path)
    assert path.name == "step_3"
    seen = {}
    state = checkpoints.restore(
        path, {"actor": lambda p: seen.update(w=Path(p, "weights.txt").read_text())}, MANIFEST
    )
    assert state == {"step": 3, "kl": 3} and seen == {"w": "w3"}


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed (fault hook) while writing step 2: step 1 stays the latest,
    the partial step_2.tmp is never loaded and the next save removes it."""
    code = (
        "import sys; from tests.core.test_checkpoints import _save; from pathlib import Path;"
        "_save(Path(sys.argv[1]), 1); _save(Path(sys.argv[1]), 2)"
    )
    env = {**os.environ, faults.ENV: "kill_in_save@2"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env)
    assert proc.returncode == -signal.SIGKILL
    partial = tmp_path / "checkpoints" / "step_2.tmp"
    assert (partial / "actor" / "weights.txt").read_text() == "w2"  # killed mid-save
    assert not (partial / checkpoints.STATE).exists()
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_1"
    # Even a partial directory that got as far as its state file is not a checkpoint.
    checkpoints.write_json(partial / checkpoints.STATE, {"step": 2})
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_1"
    _save(tmp_path, 3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_3"]


def test_mismatch_names_every_difference_and_the_fix(tmp_path):
    path = _save(tmp_path, 1)
    run = {
        **MANIFEST,
        "backend": "jax_pjit",
        "model": {"hidden_size": 64, "num_hidden_layers": 2},
    }
    with pytest.raises(checkpoints.CheckpointMismatch) as err:
        checkpoints.restore(path, {"actor": _writer("x")}, run)
    msg = str(err.value)
    assert "backend" not in msg  # the other backend's checkpoint is converted, not refused
    assert "hidden_size 32 vs 64" in msg and "polyrl.RunConfig.model_path" in msg
    assert "num_hidden_layers" not in msg  # only what differs is named
    assert not (path / "actor" / "x").exists()  # nothing was loaded


def test_checkpoint_files_are_json(tmp_path):
    path = _save(tmp_path, 1)
    assert json.loads((path / checkpoints.MANIFEST).read_text()) == MANIFEST


def _train(capsys, *params: str) -> tuple[int, str]:
    args = ["train", "--gin_file", "gin/experiments/tiny_grpo.gin"]
    for p in params:
        args += ["--gin_param", p]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_unwritable_or_full_run_dir_fails_before_any_worker(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out = _train(capsys, f"polyrl.RunConfig.run_dir = {str(blocker / 'run')!r}")
    assert code == 1
    assert f"polyrl.RunConfig.run_dir={str(blocker / 'run')!r} is not writable" in out

    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "disk_full@run_dir=0")
    code, out = _train(capsys, f"polyrl.RunConfig.run_dir = {str(run)!r}")
    assert code == 1 and "0 MiB free, the run needs about" in out, out
    assert not (run / "operative_config.gin").exists()  # refused before the run began


def test_fault_spec_errors_name_the_entry(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan_loss@actor=x")
    with pytest.raises(ValueError, match="bad entry 'nan_loss@actor=x'"):
        faults.active("nan_loss", 0, "actor")


def test_nonfinite_guard_counts_consecutive_bad_steps(capsys):
    from polyrl.cluster.reliability import NonFiniteGuard

    guard = NonFiniteGuard(limit=2)
    bad = {"actor/nonfinite_skipped": 0.5, "actor/loss": float("nan")}
    assert not guard.observe(0, {"actor/nonfinite_skipped": 0.0})
    assert not guard.observe(1, bad)
    assert not guard.observe(2, {"actor/nonfinite_skipped": 0.0})  # the streak resets
    assert not guard.observe(3, {"critic/nonfinite_skipped": 1.0})
    assert guard.observe(4, bad) and guard.streak == 2
    out = capsys.readouterr().out
    assert "[nonfinite] step 1: actor update skipped (50% of its updates; loss nan" in out
    assert "[nonfinite] step 3: critic update skipped" in out and "step 2" not in out
    assert not NonFiniteGuard(limit=0).observe(0, bad)  # 0: never stop
