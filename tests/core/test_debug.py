"""DebugConfig checks, and a headless DAP client against a role method paused by
polyrl.observe.debug in a plain process (no Ray: the same code path a Ray worker runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from dap_client import DAPClient, wait_for_pause

from polyrl.observe.debug import DEBUG_ENV, DebugConfig


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"DebugConfig.breakpoints: 'actor.step' is not a place"):
        DebugConfig(breakpoints=["actor.step"])
    with pytest.raises(
        ValueError,
        match=r"DebugConfig.breakpoints 'actor.forward if step ==': 'step ==' is not a Python",
    ):
        DebugConfig(breakpoints=["actor.forward if step =="])
    with pytest.raises(ValueError, match=r"DebugConfig.log_points: 'critc.forward'"):
        DebugConfig(log_points={"critc.forward": "1"})
    cfg = DebugConfig(
        breakpoints=["reward.score if min(scores) < -1"], log_points={"reward.score": "len(items)"}
    )
    assert cfg.enabled and cfg.host == "127.0.0.1"
    assert cfg.points("reward", "score") == [("break", "min(scores) < -1"), ("log", "len(items)")]
    assert cfg.points("actor", "train_step") == []


def test_debugging_lifts_the_timeouts_a_pause_would_trip(tmp_path):
    """--debug: no reward, rollout, env-step or agent timeout cuts a paused call; without
    it the configured ones stand."""
    from polyrl.configure.launch import parse_config
    from polyrl.envs import EpisodeConfig
    from polyrl.observe.debug import for_debugging

    params = [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"]
    cfg, _ = parse_config(["gin/experiments/tiny_multiturn.gin"], params)
    assert cfg.episodes == EpisodeConfig(max_turns=4, max_episode_tokens=64, env_workers=1)
    assert for_debugging(cfg).episodes == cfg.episodes  # no --debug: unchanged
    debugged = for_debugging(cfg, flag=True)
    assert debugged.debug.enabled and debugged.reward_timeout_s is None
    year = 365 * 24 * 3600.0
    assert debugged.episodes.env_timeout_s == debugged.episodes.agent_timeout_s == year
    assert debugged.episodes.max_turns == 4 and debugged.rollout.request_timeout_s == year
    single, _ = parse_config(["gin/experiments/tiny_grpo.gin"], params)
    assert for_debugging(single, flag=True).episodes is None


ROLE = textwrap.dedent(
    """
    import os
    from types import SimpleNamespace

    from polyrl.observe.debug import place, setup_worker

    setup_worker("actor", 0)

    class Worker:
        @place("train_step")
        def train_step(self, batch, lr):
            return {"loss": sum(batch.x) * lr}

        @place("forward")
        def forward(self, batch):
            if batch.info["step"] == 1 and os.environ.get("ROLE_RAISES"):  # 1 / 0
                return batch.x[0] / (batch.x[0] - 1)
            return batch.x

    w = Worker()
    for step in range(3):
        batch = SimpleNamespace(info={"step": step}, x=[step, 10])
        w.forward(batch)
        print("loss", w.train_step(batch, lr=0.5)["loss"], flush=True)
    """
)


def _role_process(config: DebugConfig, script, raises: bool = False) -> subprocess.Popen:
    script.write_text(ROLE)
    env = {**os.environ, DEBUG_ENV: json.dumps(config.__dict__), "PYTHONUNBUFFERED": "1"}
    env |= {"ROLE_RAISES": "1"} if raises else {}
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_conditional_breakpoint_and_log_point_through_dap(tmp_path):
    proc = _role_process(
        DebugConfig(
            breakpoints=["actor.train_step if step == 2"],
            log_points={"actor.forward": "batch.x[0] * 100"},
        ),
        tmp_path / "role.py",
    )
    seen: list[str] = []
    try:
        m = wait_for_pause(proc, seen, timeout_s=60)
        role, rank, where, line, host, port = m.groups()
        assert (role, rank, host) == ("actor", "0", "127.0.0.1")
        # the log points ran without pausing, and the steps before the condition held did too
        out = "".join(seen)
        assert "[debug] log point actor.forward rank 0 step 0: batch.x[0] * 100 = 0" in out
        assert "step 2: batch.x[0] * 100 = 200" in out
        assert "loss 5.0" in out and "loss 5.5" in out
        dap = DAPClient(host, int(port))
        stopped = dap.attach()
        frame = dap.top_frame(stopped["threadId"])
        assert (frame["source"]["path"], frame["line"]) == (str(tmp_path / "role.py"), int(line))
        local = dap.local_variables(frame["id"])
        assert local["step"] == "2" and local["lr"] == "0.5"
        assert dap.evaluate("sum(batch.x) * lr", frame["id"]) == "6.0"
        dap.request("continue", threadId=stopped["threadId"])
        dap.close()
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert "loss 6.0" in rest


TWO_BREAKPOINTS = textwrap.dedent(
    """
    import threading

    from polyrl.observe.debug import setup_worker

    setup_worker("env", 0)


    def step(turn):
        breakpoint()  # the first pause of the process
        return turn + 1


    def tool(x):
        breakpoint()  # the second: after debugpy is loaded, and in another thread
        return 2 * x


    result = {}
    thread = threading.Thread(target=lambda: result.update(tool=tool(step(1))))
    thread.start()
    thread.join()
    print("result", result["tool"], flush=True)
    """
)


def test_every_breakpoint_pauses_not_only_the_first(tmp_path):
    """Two breakpoint() calls in one debugged process (an env step, then a tool in a
    thread): both pause, each announced, and a debugger that stays attached stops at
    both. debugpy installs its own breakpointhook when first loaded; the second pause
    would be silent without ours."""
    script = tmp_path / "env.py"
    script.write_text(TWO_BREAKPOINTS)
    env = {**os.environ, DEBUG_ENV: json.dumps(DebugConfig(enabled=True).__dict__)}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    try:
        dap = None
        for name, value in (("turn", "1"), ("x", "2")):
            m = wait_for_pause(proc, seen, timeout_s=60)
            role, rank, where, line, host, port = m.groups()
            assert (role, rank, where) == ("env", "0", str(script)), m.group(0)
            if dap is None:  # attach once, as an IDE does, and stay attached
                dap = DAPClient(host, int(port))
                stopped = dap.attach()
            else:
                stopped = dap.event("stopped")
            frame = dap.top_frame(stopped["threadId"])
            assert frame["line"] == int(line) + 1  # the line after breakpoint()
            assert dap.local_variables(frame["id"])[name] == value
            dap.request("continue", threadId=stopped["threadId"])
        dap.close()
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "result 4" in rest, "".join(seen) + rest


def test_post_mortem_pauses_where_the_role_raised(tmp_path):
    proc = _role_process(DebugConfig(post_mortem=True), tmp_path / "role.py", raises=True)
    seen: list[str] = []
    try:
        m = wait_for_pause(proc, seen, timeout_s=60)
        dap = DAPClient(m.group(5), int(m.group(6)))
        stopped = dap.attach()
        assert stopped["reason"] == "exception"
        info = dap.request("exceptionInfo", threadId=stopped["threadId"])
        assert info["exceptionId"].startswith("ZeroDivisionError")
        frame = dap.top_frame(stopped["threadId"])
        assert dap.evaluate("batch.info['step']", frame["id"]) == "1"
        dap.request("continue", threadId=stopped["threadId"])
        dap.close()
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "ZeroDivisionError" in rest


def test_driver_prints_the_pause_and_repeats_nobody_attached():
    import time

    import ray
    from ray.experimental import internal_kv

    from polyrl.observe.debug import KV_PREFIX, DebugSession

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    said: list[str] = []
    session = DebugSession(DebugConfig(enabled=True, report_every_s=1.0), echo=said.append)
    try:
        record = {"role": "critic", "rank": 1, "where": "/x/workers.py:71", "host": "127.0.0.1"}
        record |= {"port": 5678, "pid": 42, "since": time.time()}
        internal_kv._internal_kv_put(f"{KV_PREFIX}42", json.dumps(record))  # what a worker writes
        deadline = time.monotonic() + 20
        while len(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        internal_kv._internal_kv_del(f"{KV_PREFIX}42")  # attached
    finally:
        session.close()
        ray.shutdown()
    assert said[0] == "[debug] critic rank 1 paused at /x/workers.py:71; attach to 127.0.0.1:5678"
    assert said[1].startswith(
        "[debug] critic rank 1 still paused at /x/workers.py:71: nobody attached for "
    )
    assert sys.breakpointhook is sys.__breakpointhook__  # the driver's breakpoint() is back
