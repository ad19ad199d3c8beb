"""Faults during real runs (tiny model, real Ray and vLLM), injected by ``polyrl.faults``:
a driver killed while it writes a checkpoint, non-finite steps, a dead training worker,
failed writes. docs/reliability.md lists the outcomes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from run_checks import assert_same_steps

from polyrl import checkpoints, faults
from polyrl.cluster.reliability import RunStopped
from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
GIN = {
    "torch_fsdp": "gin/experiments/tiny_grpo.gin",
    "jax_pjit": "gin/experiments/tiny_grpo_jax.gin",
}


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


def _driver(backend: str, params: list[str], flag: str = "", fault: str = "") -> subprocess.Popen:
    """``polyrl train [flag]`` in its own process group (its Ray processes die with it)."""
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", GIN[backend]]
    cmd += [a for p in params for a in ("--gin_param", p)] + ([flag] if flag else [])
    env = {**os.environ, "RAY_ADDRESS": "local"}
    env.pop(faults.ENV, None)
    env |= {faults.ENV: fault} if fault else {}
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group: the driver and the Ray processes it started."""
    with contextlib.suppress(ProcessLookupError):  # all of them gone already
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_after_progress(proc: subprocess.Popen, step: int, total: int, delay: float) -> None:
    """SIGKILL ``proc``'s process group ``delay`` s after it printed step ``step``'s
    progress line: the kill lands in that step's checkpoint save or in the next step."""
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if f"] step {step}/{total} " in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout=600), f"step {step} never finished"
    time.sleep(delay)
    _kill_group(proc)


def _samples(run: Path) -> dict[int, list[tuple[int, str]]]:
    """Step -> its logged (data row, response) pairs (rollouts.jsonl, every sample)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for r in read_jsonl(run / "rollouts.jsonl"):
        out.setdefault(r["step"], []).append((r["prompt_index"], r["response"]))
    return out


@pytest.mark.parametrize(
    "backend, kills, total",
    [
        # default tier: the dead-worker test below (test_trainer's killed run is slow too)
        pytest.param("jax_pjit", ("step", "save"), 8, marks=pytest.mark.slow),
        pytest.param("torch_fsdp", ("step", "save", "step"), 11, marks=pytest.mark.slow),
        pytest.param("jax_pjit", ("step", "save", "step"), 11, marks=pytest.mark.slow),
    ],
    ids=["jax-2-kills", "torch-3-kills", "jax-3-kills"],
)
def test_kills_at_random_steps_then_resume(backend, kills, total, ray_session, tmp_path):
    """The driver is SIGKILLed again and again, each time at a seeded-random point after
    the latest checkpoint: ``step`` kills come from outside, a random 0-0.6 s (about one
    step here) after a step's progress line (inside that step's checkpoint save or the
    next step), ``save`` kills inside a checkpoint save (``kill_in_save``, after the
    engines wrote); each kill is followed by ``--resume-or-start``. The finished run's metrics
    equal an uninterrupted run's, and it logs every step's samples once: the same data
    rows and responses. A partial checkpoint is ignored and removed by the next save;
    the other backend's run would convert them."""
    rng = random.Random(15)
    sampled = ("polyrl.RunConfig.dump_every = 1", "polyrl.RunConfig.dump_samples = 128")
    common = [f"polyrl.RunConfig.total_steps = {total}", "polyrl.RunConfig.save_every = 1"]
    common += sampled
    train([GIN[backend]], _params(tmp_path / "full", *common))
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")

    run = tmp_path / "run"
    params, tried = _params(run, *common), []
    for n, kind in enumerate(kills):
        # a restarted job: a kill may land before the first checkpoint is complete
        flag = "--resume-or-start" if n > 0 else ""
        last = checkpoints.latest_checkpoint(run)
        at = (int(last.name.split("_")[1]) if last else 0) + rng.randint(1, 3)
        # a step kill needs steps after it to land in; a save kill fires at any save
        assert at <= total - (2 if kind == "step" else 0), "kills do not fit in total_steps"
        if kind == "save":
            proc = _driver(backend, params, flag, fault=f"kill_in_save@{at}")
            try:
                proc.communicate(timeout=600)
            finally:
                _kill_group(proc)
            assert (run / "checkpoints" / f"step_{at}.tmp" / "actor").is_dir()
            assert not (run / "checkpoints" / f"step_{at}.tmp" / "trainer_state.json").exists()
            tried.append(f"in step_{at} save")
        else:
            delay = round(rng.uniform(0.0, 0.6), 2)
            proc = _driver(backend, params, flag)
            try:
                _kill_after_progress(proc, at, total, delay)
            finally:
                _kill_group(proc)
                proc.wait()
            tried.append(f"{delay} s after step {at}")
        assert proc.returncode == -signal.SIGKILL, (kind, at)
    print(f"[{backend}] kills: {tried}")  # -s shows where the kills landed

    train([GIN[backend]], params, resume=True)
    resumed = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, total + 1))  # each step once
    assert_same_steps(resumed, full)  # same seeds, data order and optimizer state
    want, got = _samples(tmp_path / "full"), _samples(run)
    assert sorted(got) == list(range(1, total + 1)) and got == want
    rows = [i for step in got.values() for i, _ in step]
    # 16 prompts x n=8 a step, no row twice: the data order continued where it stopped.
    assert len(set(rows)) == 16 * total and len(rows) == 8 * len(set(rows))
    assert not list((run / "checkpoints").glob("*.tmp"))  # the next save removed it

    # The other backend's run takes these checkpoints over (converted on restore:
    # tests/trainer/test_cross_backend_resume.py); the pre-start check says which.
    other = "torch_fsdp" if backend == "jax_pjit" else "jax_pjit"
    manifest = json.loads((checkpoints.latest_checkpoint(run) / checkpoints.MANIFEST).read_text())
    assert (
        checkpoints.check_resumable(
            checkpoints.latest_checkpoint(run), {**manifest, "backend": other}
        )
        == backend
    )


@pytest.mark.slow  # the checks are in the default tier: tests/core/test_checkpoints.py, and
# tests/backends/test_checkpoint_checksums.py on real DCP and orbax checkpoints
def test_damaged_checkpoint_then_resume_uses_the_previous_one(tmp_path):
    """Issue 47: a truncated file in the newest checkpoint, then --resume: ~100 lines of
    DCP traceback after the whole start-up. Now one line names the file before anything
    starts and the run continues from the previous checkpoint. The first run, with
    --resume-or-start into an empty run dir, starts at step 0."""
    run = tmp_path / "run"
    common = ["polyrl.RunConfig.save_every = 2", "polyrl.RunConfig.keep_checkpoints = 2"]

    def train_cli(total: int, flag: str) -> str:
        proc = _driver(
            "torch_fsdp", _params(run, *common, f"polyrl.RunConfig.total_steps = {total}"), flag
        )
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            _kill_group(proc)
        assert proc.returncode == 0, out
        return out

    assert "starting at step 0" in train_cli(4, "--resume-or-start")
    shard = run / "checkpoints" / "step_4" / "actor" / "__0_0.distcp"
    written = shard.stat().st_size
    os.truncate(shard, written // 2)
    out = train_cli(6, "--resume")
    damaged = [line for line in out.splitlines() if " is damaged " in line]
    assert len(damaged) == 1, out
    assert f"actor/__0_0.distcp: {written // 2} bytes, {written} were written" in damaged[0]
    assert f"resuming from {run / 'checkpoints' / 'step_2'}" in damaged[0]
    assert f"[resume] from {run / 'checkpoints' / 'step_2'} at step 2" in out
    assert "Traceback" not in out
    print(damaged[0])
    assert (run / "checkpoints" / "step_4.damaged" / "actor" / "__0_0.distcp").stat().st_size == (
        written // 2
    )  # kept
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


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
    "backend, role, ranks, fault",
    [
        # the actor's rank 1 dies in its second step's first update, while rank 0 waits
        # for it in the gradient all-reduce
        ("torch_fsdp", "actor", 2, "kill_worker@actor:1=2"),
        pytest.param("torch_fsdp", "actor", 2, "kill_worker@actor:0=2", marks=pytest.mark.slow),
        # the reference's rank 1 dies in its third forward call (the second step's; the
        # first step scores twice: the run-time isolation check)
        pytest.param(
            "torch_fsdp", "reference", 2, "kill_in_forward@reference:1=2", marks=pytest.mark.slow
        ),
        pytest.param("jax_pjit", "actor", 1, "kill_worker@actor=2", marks=pytest.mark.slow),
    ],
)
def test_dead_worker_stops_the_run_and_resume_continues(
    backend, role, ranks, fault, ray_session, tmp_path, monkeypatch
):
    """A training worker SIGKILLs itself mid-step (fault hook) at one rank of a role: the
    run stops at once (no hang in the collective the other rank waits in), naming the
    role and rank that died and how to resume, and --resume finishes the run."""
    monkeypatch.setenv(faults.ENV, fault)
    run = tmp_path / "run"
    params = _params(run, "polyrl.RunConfig.total_steps = 2", "polyrl.RunConfig.save_every = 1")
    if ranks > 1:
        params += [f"{r}/polyrl.ParallelConfig.mesh = {{'data': 2}}" for r in {"actor", role}]
    dead = fault.partition("@")[2].partition("=")[0].partition(":")[2] or "0"
    ended = []  # when step 1 ended: the fault strikes in step 2
    with pytest.raises(RunStopped, match=rf"role '{role}' worker \(rank {dead}\) died") as err:
        train([GIN[backend]], params, on_step=lambda step, m: ended.append(time.monotonic()))
    print(f"[{backend} {fault}] stopped {time.monotonic() - ended[0]:.1f} s after step 1 ended")
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


@pytest.mark.slow  # the mechanism is in the default tier: tests/rollout/test_weight_group.py
def test_server_killed_during_group_push_in_a_run(ray_session, tmp_path, monkeypatch, caplog):
    """GRPO with the weights broadcast over a gloo group (actor and two rollout servers
    in separate pools, 'nccl' transport on CPU, ~50 KiB buckets): server 0 dies in the
    push after step 2. The push completes on server 1, server 0 is restarted and
    re-synced before step 3 generates, and every step's metrics equal a run without the
    fault (the restarted server samples exactly as the killed one would have)."""
    common = [
        "polyrl.RunConfig.total_steps = 3",
        "polyrl.RunConfig.weight_transport = 'nccl'",
        "polyrl.RunConfig.weight_bucket_mb = 0.05",
        "polyrl.RunConfig.pools = {'train': {'CPU': 1}, 'gen': {'CPU': 1}}",
        "actor/polyrl.RoleConfig.pool = 'train'",
        "reference/polyrl.RoleConfig.pool = 'train'",
        "polyrl.RolloutConfig.pool = 'gen'",
        "polyrl.RolloutConfig.num_servers = 2",
    ]
    train([GIN["torch_fsdp"]], _params(tmp_path / "full", *common))
    monkeypatch.setenv(faults.ENV, "kill_in_push@rollout:0=2")
    with caplog.at_level("WARNING", logger="polyrl.rollout.pool"):
        train([GIN["torch_fsdp"]], _params(tmp_path / "run", *common))
    assert "rollout server 0 died during weight push 2" in caplog.text
    full, run = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("full", "run"))
    assert [r["step"] for r in run] == [1, 2, 3]
    assert_same_steps(run, full)
