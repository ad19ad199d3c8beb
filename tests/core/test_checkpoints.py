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


def _train(capsys, *params: str, flags: tuple[str, ...] = ()) -> tuple[int, str]:
    args = ["train", "--gin_file", "gin/experiments/tiny_grpo.gin", *flags]
    for p in params:
        args += ["--gin_param", p]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_unwritable_or_full_run_dir_fails_before_any_worker(tmp_path, capsys, monkeypatch):
    import psutil
    import ray

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
    # the Ray begun beside the checks is gone with the refused run (issue 48)
    assert not ray.is_initialized()
    left = [p.name() for p in psutil.Process().children(recursive=True)]
    assert not {"gcs_server", "raylet"} & set(left), left


def test_resume_with_no_checkpoint_is_refused_unless_asked_to_start_fresh(tmp_path, capsys):
    """Issue 47: --resume into a run dir without a checkpoint (a gin file naming another
    run_dir) trained from step 0 and exited 0. It is refused before anything is written or
    started, naming the run dir and the flag that starts afresh."""
    run = tmp_path / "run"
    code, out = _train(capsys, f"polyrl.RunConfig.run_dir = {str(run)!r}", flags=("--resume",))
    assert code == 1, out
    assert f"polyrl.RunConfig.run_dir={str(run)!r} holds no checkpoint" in out
    assert "--resume-or-start" in out and "Traceback" not in out
    assert not (run / "operative_config.gin").exists()  # refused before the run began
    assert checkpoints.resume_point(run, start_fresh=True) is None  # --resume-or-start: step 0
    (run / "checkpoints" / "step_2.tmp").mkdir(parents=True)  # an interrupted save is none
    with pytest.raises(checkpoints.NoCheckpoint, match="--resume-or-start"):
        checkpoints.resume_point(run)


def test_damaged_checkpoint_is_named_kept_and_the_previous_one_used(tmp_path, capsys):
    """Issue 47: a truncated file in the newest checkpoint failed deep inside the engines'
    loaders. The files are checked against the checksums written at save: the damaged
    checkpoint is named in one line (file, size written vs found), moved aside (kept, never
    loaded) and the previous intact one is used; with none intact the run is refused."""
    for step in (2, 4):
        _save(tmp_path, step)
    root = tmp_path / "checkpoints"
    weights = root / "step_4" / "actor" / "weights.txt"
    written = weights.stat().st_size
    os.truncate(weights, written - 1)
    assert checkpoints.resume_point(tmp_path) == root / "step_2"
    lines = [x for x in capsys.readouterr().out.splitlines() if " is damaged " in x]
    assert len(lines) == 1, lines
    assert str(root / "step_4") in lines[0] and "actor/weights.txt" in lines[0]
    assert f"{written - 1} bytes" in lines[0] and f"{written} were written" in lines[0]
    assert str(root / "step_2") in lines[0] and "step_4.damaged" in lines[0]
    kept = root / "step_4.damaged" / "actor" / "weights.txt"
    assert kept.stat().st_size == written - 1  # nothing deleted
    assert checkpoints.latest_checkpoint(tmp_path) == root / "step_2"
    state = checkpoints.restore(root / "step_2", {"actor": lambda p: None}, MANIFEST)
    assert state["step"] == 2

    # Same size, other bytes: only the checksum tells; with no intact checkpoint left the
    # run is refused (from the CLI too, before anything starts) and nothing is moved.
    other = root / "step_2" / "actor" / "weights.txt"
    other.write_text(other.read_text().upper())
    with pytest.raises(checkpoints.CheckpointDamaged) as err:
        checkpoints.resume_point(tmp_path)
    assert "step_2" in str(err.value) and "actor/weights.txt" in str(err.value)
    assert "checksum" in str(err.value) and "run_dir" in str(err.value)
    code, out = _train(capsys, f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}", flags=("--resume",))
    assert code == 1 and "actor/weights.txt" in out and "Traceback" not in out, out
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.damaged"]


def test_checkpoint_written_before_checksums_is_used_unverified(tmp_path, capsys):
    """A checkpoint without checksums.json (written before polyrl wrote them) is used as
    before (its atomic rename vouches that it is complete), and one line says so."""
    path = _save(tmp_path, 2)
    (path / checkpoints.CHECKSUMS).unlink()
    assert checkpoints.resume_point(tmp_path) == path
    assert "not verified" in capsys.readouterr().out


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


def test_export_refuses_a_damaged_checkpoint_and_names_the_file(tmp_path, capsys):
    """`polyrl export` loads a checkpoint as --resume does: one whose files differ from the
    checksums written at save is refused before any engine loads it, naming the file and
    the other steps to export instead; the run directory is left as it was."""
    from polyrl.configure.hf_export import export_checkpoint

    for step in (2, 4):
        _save(tmp_path, step)
    weights = tmp_path / "checkpoints" / "step_4" / "actor" / "weights.txt"
    os.truncate(weights, weights.stat().st_size - 1)
    with pytest.raises(checkpoints.CheckpointDamaged) as err:
        export_checkpoint(tmp_path, tmp_path / "hf_out")
    message = str(err.value)
    assert "step_4" in message and "actor/weights.txt" in message and "--step 2" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert not (tmp_path / "hf_out").exists()
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf_out")]) == 2
    err = capsys.readouterr().err
    assert "actor/weights.txt" in err and "Traceback" not in err, err
