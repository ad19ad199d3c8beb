"""A run is quiet and ends with its driver: one line per step (no worker noise, no gin
lookup errors), every worker's output kept in RUN_DIR/logs, and after a SIGKILL of the
driver no process of the run is left; Ctrl-C ends a run quietly with its files intact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(
    run_dir: Path, *bindings: str, gin: str = "gin/experiments/tiny_grpo.gin"
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "POLYRL_VERBOSE")}
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", gin]
    for b in (f"polyrl.RunConfig.run_dir = {str(run_dir)!r}", *bindings):
        cmd += ["--gin_param", b]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a signal to it reaches no test
    )


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.time() + 300
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.time() < deadline, "run died or never stepped"
        time.sleep(0.5)


def test_killed_driver_leaves_no_process_and_the_run_was_quiet(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "polyrl.RunConfig.total_steps = 1000", "polyrl.RunConfig.dump_every = 3")
    try:
        _wait_for_steps(run, proc, 4)
        tree = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 4, tree  # Ray's own processes and the role workers
        # Ray starts beside the checks (issue 48): its GCS before the operative config,
        # which the driver writes once they pass
        (gcs,) = [p for p in tree if p.name() == "gcs_server"]
        assert gcs.create_time() < (run / "operative_config.gin").stat().st_mtime
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert "Failed to load weights" not in out and "ERROR:root" not in out, out
    assert "(RolloutServer" not in out and "[generate]" not in out, out  # quiet by default
    # one line of start-up times; the servers start while the roles do, and no second of
    # it is counted in two phases ("other", the rest of the total, is not negative)
    (startup,) = [line for line in out.splitlines() if "s before the first step" in line]
    parts = dict(re.findall(r", ([a-z ]+) (-?[0-9.]+) s", startup))
    assert {"rollout servers", "actor workers", "reference workers"} <= set(parts), startup
    assert float(parts["other"]) >= 0, startup
    steps = [line for line in out.splitlines() if "] step " in line and "/1000" in line]
    assert len(steps) >= 4 and steps[0].startswith("[") and "step 1/1000" in steps[0]
    assert (
        "[rollouts] step 1: 4 samples" in out
        and "  [sample] step 3: '<|im_start|>user:copy " in out
    )
    logs = list((run / "logs").glob("worker-*"))
    text = "".join(p.read_text(errors="replace") for p in logs)
    assert "Initializing a V1 LLM engine" in text  # vLLM's full start-up log is kept
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]  # the numbers the log shows


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_ends_quietly_with_checkpoint_and_metrics(tmp_path, how):
    """Ctrl-C, or SIGTERM to the driver alone (a scheduler; a sweep stopping a trial,
    issue 34: its log had a native SIGTERM dump): the same quiet end, exit code 130."""
    run = tmp_path / "run"
    proc = _start(run, "polyrl.RunConfig.total_steps = 1000", "polyrl.RunConfig.save_every = 2")
    try:
        _wait_for_steps(run, proc, 3)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "interrupted" in out, out[-3000:]
    assert "SIGTERM received" not in out and "PC: @" not in out, out[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert (run / "checkpoints" / "step_2" / "trainer_state.json").exists()
    # the last line says how to continue: from the newest complete checkpoint
    said = re.search(r"the last good checkpoint is (\S+); --resume continues from it", out)
    assert said and Path(said[1]).parent == run / "checkpoints", out[-3000:]
    assert f"<same --gin_file/--gin_param> --resume (run dir {run})" in out, out[-3000:]


def test_ctrl_c_before_the_first_checkpoint_says_there_is_none(tmp_path):
    """The interrupt line said "continue with --resume" also with no checkpoint yet, and
    --resume then refuses the run dir. SFT on the tiny model: no rollout servers, a
    quick start."""
    run = tmp_path / "run"
    steps = "polyrl.RunConfig.total_steps = 1000"
    proc = _start(run, steps, "polyrl.RunConfig.save_every = 0", gin="gin/experiments/tiny_sft.gin")
    try:
        _wait_for_steps(run, proc, 1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert "there is no checkpoint yet" in out, out[-3000:]
    assert f"<same --gin_file/--gin_param> --resume-or-start (run dir {run})" in out, out[-3000:]
    assert not re.search(r"--resume(?!-or-start)", out), out[-3000:]


@pytest.mark.slow
def test_demo_output_stays_short(tmp_path):
    # `make demo`: tiny_grpo.gin plus validation every 10 steps
    proc = _start(tmp_path / "demo", gin="gin/experiments/tiny_grpo_val.gin")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert len(lines) < 150, "\n".join(lines)
    assert sum("] step " in line and "/80" in line for line in lines) == 80
