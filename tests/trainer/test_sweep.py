"""`polyrl sweep` end to end on the tiny experiment (real Ray Tune, Ray, vLLM): ASHA stops
trials early with two at a time, results are ranked by the smoothed metric; a sweep started
from another directory resolves its relative paths there; a bad value fails its trial alone."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_checks import assert_same_steps

from polyrl.loop.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "polyrl.cli", "sweep", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _table(root: Path) -> list[dict]:
    return list(csv.DictReader((root / "results.csv").open()))


@pytest.mark.slow
def test_asha_sweep_runs_two_at_a_time_and_stops_early(tmp_path):
    root = tmp_path / "sweep"
    # ASHA stops a trial that reaches a rung behind the ones recorded there before it:
    # the best learning rates first, so the later, worse ones meet a cutoff whatever
    # the timing of the first two (the grid's own order makes that a race).
    best_first = "{'actor/polyrl.OptimConfig.lr': {'grid': [1e-2, 3e-3, 1e-3, 3e-4]}}"
    out = sweep(
        "--gin_file",
        "gin/sweeps/tiny_grpo_lr.gin",
        "--gin_param",
        f"polyrl.RunConfig.run_dir = {str(root)!r}",
        "--gin_param",
        f"polyrl.SweepConfig.space = {best_first}",
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _table(root)
    assert len(rows) == 4 and {r["status"] for r in rows} <= {"done", "stopped"}
    steps = [int(r["steps"]) for r in rows]
    assert max(steps) == 16 and min(steps) < 16, rows  # ASHA stopped at least one early
    smoothed = [float(r["smoothed_last_4"]) for r in rows]
    assert smoothed == sorted(smoothed, reverse=True)  # ranked by the smoothed metric
    for r in rows:  # the smoothed value is the mean of the trial's last 4 logged rewards
        metrics = [json.loads(x) for x in (root / r["trial"] / "metrics.jsonl").open()]
        tail = [m["reward/mean"] for m in metrics][-4:]
        assert float(r["smoothed_last_4"]) == pytest.approx(sum(tail) / len(tail))
    assert (root / "curves.png").exists() and (root / "best_operative_config.gin").exists()
    # Two 1-CPU trials fit the 2-CPU machine, never three: count overlapping lifetimes.
    spans = []
    for r in rows:
        info = json.loads((root / r["trial"] / "trial.json").read_text())
        end = info.get("ended", (root / r["trial"] / "metrics.jsonl").stat().st_mtime)
        spans.append((info["started"], end))
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == 2, spans
    assert out.stdout.count("[sweep] ") >= 8  # a line per started and per ended trial


@pytest.mark.slow
def test_sweep_from_another_directory_with_a_bad_trial(tmp_path):
    shutil.copy(ROOT / "experiments" / "own_task" / "min_digit.py", tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        from min_digit import make_min
    finally:
        sys.path.remove(str(tmp_path))
    rng = random.Random(0)
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "train.jsonl").open("w") as f:
        for _ in range(64):
            text, answer = make_min(rng)
            row = {"prompt": [{"role": "user", "content": text}], "ground_truth": answer}
            f.write(json.dumps(row | {"data_source": "my/min_digit"}) + "\n")
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "base.gin").write_text(
        "include 'gin/experiments/tiny_grpo.gin'\n"
        "polyrl.RunConfig.total_steps = 2\n"
        "polyrl.RunConfig.tensorboard = False\n"
        'polyrl.RunConfig.pools = {"shared": {"CPU": 1.0, "GPU": 0.0}}\n'
    )
    (tmp_path / "exp" / "sweep.gin").write_text(
        "include 'exp/base.gin'\n"  # relative to the directory polyrl runs in
        'polyrl.RunConfig.run_dir = "out"\n'
        'polyrl.RunConfig.train_files = ["data/train.jsonl"]\n'
        # 5 does not divide prompts_per_step = 16: that trial fails validation
        'polyrl.SweepConfig.grid = {"polyrl.RunConfig.mini_batch_prompts": [8, 5]}\n'
    )
    out = sweep("--import", "min_digit", "--gin_file", "exp/sweep.gin", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["trial"]: r for r in _table(tmp_path / "out")}
    good, bad = rows["00_mini_batch_prompts=8"], rows["01_mini_batch_prompts=5"]
    assert good["status"] == "done" and good["steps"] == "2" and good["rank"] == "1"
    assert bad["status"] == "error" and "mini_batch_prompts" in bad["error"], bad
    assert "FAILED" in out.stdout


def _lr_grid_args(root, *run_params: str) -> list[str]:
    """`polyrl sweep` arguments: the tiny GRPO over two learning rates, one trial after
    the other, in ``root``, with ``polyrl.RunConfig.<p>`` for each of ``run_params``."""
    args = [
        "--gin_file",
        "gin/sweeps/tiny_grpo_lr.gin",
        "--gin_param",
        f"polyrl.RunConfig.run_dir = {str(root)!r}",
        "--gin_param",
        "polyrl.SweepConfig.space = {'actor/polyrl.OptimConfig.lr': {'grid': [3e-3, 1e-2]}}",
        "--gin_param",
        "polyrl.SweepConfig.scheduler = 'fifo'",
    ]
    for p in run_params:
        args += ["--gin_param", f"polyrl.RunConfig.{p}"]
    return args


@pytest.mark.slow
def test_interrupted_sweep_resumes_and_finishes_every_trial(tmp_path):
    """Ctrl-C a sweep while its trials run, then `polyrl sweep --resume`: every trial ends
    with all its steps, each step logged once (a resumed trial continues from its
    checkpoint, it does not start again)."""
    import signal
    import time

    root = tmp_path / "sweep"
    args = _lr_grid_args(root, "save_every = 2")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "polyrl.cli", "sweep", *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 600
    while time.time() < deadline:  # interrupt once a trial has a checkpoint and more steps
        logs = list(root.glob("*/metrics.jsonl"))
        if any(sum(1 for _ in p.open()) >= 5 for p in logs):
            break
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    before = {p.parent.name: sum(1 for _ in p.open()) for p in root.glob("*/metrics.jsonl")}
    assert before and min(before.values()) < 16, before  # interrupted mid-run
    out = sweep(*args, "--resume", cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(root)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"done"}, rows
    for r in rows:
        steps = [json.loads(x)["step"] for x in (root / r["trial"] / "metrics.jsonl").open()]
        assert steps == list(range(1, 17)), (r["trial"], steps)


def _rollouts(run: Path, steps: range) -> dict[int, list[tuple[int, str]]]:
    """Step -> its logged (data row, response) pairs, for ``steps``; none where the run
    has no dump yet (a trial killed before its first step: its metrics.jsonl is there, empty)."""
    out: dict[int, list[tuple[int, str]]] = {}
    if not (run / "rollouts.jsonl").exists():
        return out
    for line in (run / "rollouts.jsonl").open():
        r = json.loads(line)
        if r["step"] in steps:
            out.setdefault(r["step"], []).append((r["prompt_index"], r["response"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_killed_sweep_resumes_each_trial_where_it_stopped(tmp_path, backend):
    """`kill -9` of the whole sweep (driver, Ray, trials) once a trial has logged steps
    after its step-4 checkpoint, then `polyrl sweep --resume`: every trial continues from
    its checkpoint, the steps it takes again equal the ones the killed, uninterrupted
    process had logged (metrics, data rows, sampled responses), and each step and data
    row is logged once."""
    import signal
    import time

    import psutil

    root = tmp_path / "sweep"
    args = _lr_grid_args(
        root,
        f"backend = {backend!r}",
        "total_steps = 10",
        "save_every = 4",
        "dump_every = 1",
        "dump_samples = 128",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "polyrl.cli", "sweep", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once a trial logged a step past its checkpoint
        if any(sum(1 for _ in p.open()) >= 6 for p in root.glob("*/metrics.jsonl")):
            break
        assert proc.poll() is None, "the sweep ended before it was killed"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    def trial_processes() -> list:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if any(str(root) in a for a in (p.info["cmdline"] or []))
        ]

    while trial_processes():  # the trials' runs die with the sweep (parent-death signal)
        assert time.time() < deadline + 60, trial_processes()
        time.sleep(0.5)
    before = {p.parent.name: read_jsonl(p) for p in root.glob("*/metrics.jsonl")}
    logged = {n: _rollouts(root / n, range(5, 11)) for n in before}
    assert before and min(len(r) for r in before.values()) < 10, before  # killed mid-run
    out = sweep(*args, "--resume", cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(root)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"done"}, rows
    compared = 0
    for r in rows:
        run = root / r["trial"]
        after = read_jsonl(run / "metrics.jsonl")
        assert [m["step"] for m in after] == list(range(1, 11)), r["trial"]
        taken_again = before.get(r["trial"], [])[4:]  # steps 5.. of the killed process
        assert_same_steps([after[old["step"] - 1] for old in taken_again], taken_again)
        compared += len(taken_again)
        samples = _rollouts(run, range(1, 11))
        for step, pairs in logged.get(r["trial"], {}).items():
            if step <= len(before[r["trial"]]):  # dumped and logged before the kill
                assert samples[step] == pairs, (r["trial"], step)
        data_rows = [i for pairs in samples.values() for i, _ in pairs]
        assert sorted(samples) == list(range(1, 11))
        # 16 prompts x n=8 a step, no row twice: the data order continued where it stopped.
        assert len(set(data_rows)) == 160 and len(data_rows) == 8 * 160
    assert compared >= 1  # at least one step was taken both before and after the kill
    print(f"killed at rows {[len(v) for v in before.values()]}; {compared} steps compared")
