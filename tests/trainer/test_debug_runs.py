"""`polyrl train --debug` on the tiny model (real vLLM CPU, real Ray): a headless Debug
Adapter Protocol client attaches to a user reward function's breakpoint() in its reward
worker, then to a conditional breakpoint in the actor's forward; a log point in the
rollout server logs without pausing; the run completes."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from dap_client import DAPClient, wait_for_pause

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from local_cluster import _free_ports, cluster_env, local_cluster  # noqa: E402

from polyrl.loop.metrics import read_jsonl  # noqa: E402

ROOT = HERE.parents[1]

REWARD = textwrap.dedent(
    """
    from polyrl.rewards import REWARDS
    from polyrl.rewards.rules import positional_match

    paused = False


    def copy_with_a_breakpoint(response, ground_truth, extra_info=None):
        global paused
        if not paused:
            paused = True
            breakpoint()  # the line the debugger stops after
        return positional_match(response, ground_truth, extra_info)


    REWARDS["polyrl/copy"] = copy_with_a_breakpoint
    """
)


def _inspect_and_continue(proc, seen, expect_role, check) -> None:
    m = wait_for_pause(proc, seen, timeout_s=240)
    role, rank, where, line, host, port = m.groups()
    assert (role, rank, host) == (expect_role, "0", "127.0.0.1"), m.group(0)
    dap = DAPClient(host, int(port))
    stopped = dap.attach()
    frame = dap.top_frame(stopped["threadId"])
    check(dap, frame, where, int(line))
    dap.request("continue", threadId=stopped["threadId"])
    dap.close()


def _in_actor_forward(expression: str, want: str):
    """The check of a pause at the ``actor.forward if step == 1`` breakpoint: in
    polyrl/cluster/workers.py at the reported line, step 1, ``expression`` evaluating to ``want``."""

    def check(dap, frame, where, line):
        assert where.endswith("polyrl/cluster/workers.py") and frame["line"] == line
        assert dap.local_variables(frame["id"])["step"] == "1"
        assert dap.evaluate(expression, frame["id"]) == want

    return check


def start_run(
    tmp_path, module: str | None, *bindings: str, env=None, gin: str = "tiny_grpo.gin"
) -> subprocess.Popen:
    """``polyrl train --debug [--import <module>]`` of the tiny GRPO (or ``gin``) in
    ``tmp_path``."""
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--debug"]
    cmd += ["--import", module] if module else []
    cmd += ["--gin_file", str(ROOT / "gin/experiments" / gin)]
    for b in (
        f"polyrl.RunConfig.run_dir = {str(tmp_path / 'run')!r}",
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.reward_workers = 1",
        *bindings,
    ):
        cmd += ["--gin_param", b]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_debugger_attaches_to_remote_roles(tmp_path):
    (tmp_path / "dbg_rewards.py").write_text(REWARD)
    proc = start_run(
        tmp_path,
        "dbg_rewards",
        "polyrl.RunConfig.total_steps = 3",
        # once per step (train_step runs once per mini-batch: twice a step here)
        'polyrl.DebugConfig.breakpoints = ["actor.forward if step == 1"]',
        'polyrl.DebugConfig.log_points = {"rollout.generate": "len(requests)"}',
    )
    seen: list[str] = []
    try:

        def in_reward(dap, frame, where, line):
            assert where == str(tmp_path / "dbg_rewards.py")  # the line of its breakpoint()
            assert frame["source"]["path"] == str(tmp_path / "dbg_rewards.py")
            local = dap.local_variables(frame["id"])
            assert set(local) >= {"response", "ground_truth", "extra_info"}
            assert dap.evaluate("paused, len(ground_truth)", frame["id"]) == "(True, 3)"

        _inspect_and_continue(proc, seen, "reward", in_reward)

        # 16 prompts x n=8
        _inspect_and_continue(proc, seen, "actor", _in_actor_forward("len(batch)", "128"))
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-5000:]
    assert "[debug] Ray distributed debugger on; dashboard http://127.0.0.1:" in out
    # 16 prompts x n=8 = 128 requests per step, each step logged, nobody paused for it
    assert (
        out.count("[debug] log point rollout.generate rank 0 step None: len(requests) = 128") == 3
    )
    assert "[polyrl] done" in out


ENV_AND_TOOL = textwrap.dedent(
    """
    from polyrl.data.tasks import register_task
    from polyrl.envs import ToolEnv, register_env
    from polyrl.envs.parsers import ParseResult
    from polyrl.envs.tools import Tool, ToolCall

    STOP_IN = "{where}"
    paused = set()


    def double(x):
        if STOP_IN == "tool" and x == "1" and not paused:  # the second turn's call
            paused.add("tool")
            breakpoint()  # the line the debugger stops after
        return str(2 * int(x))


    DOUBLE = Tool(
        "double",
        "Doubles a number.",
        {{"type": "object", "properties": {{"x": {{"type": "string"}}}}, "required": ["x"]}},
        double,
        timeout_s=0.5,
    )


    @register_env("dbg/double")
    class Doubler(ToolEnv):
        tools = (DOUBLE,)

        def parse(self, turn):  # every turn calls the tool with the turn's index
            return ParseResult("", [ToolCall("double", {{"x": str(turn.index)}}, "")], [])

        def step(self, turn):
            if STOP_IN == "step" and not paused:
                paused.add("step")
                breakpoint()
            return super().step(turn)


    register_task("dbg", "dbg/double", lambda rng: ("secret", "1"), "the debugger test's env")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "expression", "want"),
    [("step", "turn.index, sorted(paused)", "(0, ['step'])"), ("tool", "x", "'1'")],
)
def test_debugger_stops_in_an_env_step_or_in_a_tool(tmp_path, where, expression, want):
    """A breakpoint() in an environment's step, or in a tool it calls, pauses in the env
    worker (role ``env``) under --debug, with the locals of its frame; neither the env
    timeout (1 s) nor the tool's (0.5 s) cuts the paused call: every episode plays its
    four turns, each tool call succeeds. (One pause a run: a later pause in the same
    worker with the debugger still attached is not stopped at yet; docs/debugging.md.)"""
    (tmp_path / "dbg_env.py").write_text(ENV_AND_TOOL.format(where=where))
    proc = start_run(
        tmp_path,
        "dbg_env",
        "polyrl.RunConfig.total_steps = 1",
        'polyrl.RunConfig.task = "dbg"',
        "polyrl.EpisodeConfig.env_timeout_s = 1.0",
        gin="tiny_multiturn.gin",
    )
    seen: list[str] = []
    module = str(tmp_path / "dbg_env.py")
    # a pause the driver never reports leaves the run silent, and the output reader
    # waiting on it: end the run instead of hanging the test session
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    try:

        def check(dap, frame, at, line):
            assert at == module and frame["source"]["path"] == module
            assert dap.evaluate(expression, frame["id"]) == want

        _inspect_and_continue(proc, seen, "env", check)
        rest, _ = proc.communicate(timeout=300)
    finally:
        watchdog.cancel()
        proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-5000:]
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["episode/finish/max_turns"] == 1.0, row  # no env_timeout
    assert row["episode/tool_calls_mean"] == 4.0 and row["episode/tool_errors_mean"] == 0.0


RAISING_REWARD = textwrap.dedent(
    """
    from polyrl.rewards import REWARDS


    def boxed_answer(response, ground_truth, extra_info=None):
        parsed = {"boxed": ""} if response in ("", ground_truth) else {"answer": response}
        return float(parsed["boxed"] == ground_truth)  # KeyError: the line post-mortem stops at


    REWARDS["polyrl/copy"] = boxed_answer
    """
)


@pytest.mark.slow
def test_post_mortem_pauses_the_reward_worker_where_the_reward_raised(tmp_path):
    """DebugConfig.post_mortem in a real Ray role: the user's reward raises KeyError in its
    reward worker (on a sampled response; the ground truth and an empty response, which
    polyrl scores before the run starts, parse), which pauses in the reward function's frame (not where polyrl wraps the
    error in a RewardError); after the debugger continues, the run ends naming the error."""
    (tmp_path / "pm_rewards.py").write_text(RAISING_REWARD)
    proc = start_run(
        tmp_path,
        "pm_rewards",
        "polyrl.RunConfig.total_steps = 2",
        "polyrl.DebugConfig.post_mortem = True",
    )
    seen: list[str] = []
    try:
        m = wait_for_pause(proc, seen, timeout_s=240)
        role, rank, where, line, host, port = m.groups()
        assert (role, rank, where, line) == ("reward", "0", str(tmp_path / "pm_rewards.py"), "7")
        # the driver's line names the error the role raised
        assert "(RewardError: reward for data_source 'polyrl/copy', sample 0" in m.string
        assert "raised KeyError: 'boxed')" in m.string
        dap = DAPClient(host, int(port))
        stopped = dap.attach()
        assert stopped["reason"] == "exception"
        info = dap.request("exceptionInfo", threadId=stopped["threadId"])
        assert info["exceptionId"].startswith("KeyError") and "boxed" in info["description"]
        frame = dap.top_frame(stopped["threadId"])
        assert (frame["source"]["path"], frame["line"]) == (str(tmp_path / "pm_rewards.py"), 7)
        local = dap.local_variables(frame["id"])
        assert set(local) >= {"response", "ground_truth", "parsed"}
        assert dap.evaluate("sorted(parsed), len(ground_truth)", frame["id"]) == "(['answer'], 3)"
        dap.request("continue", threadId=stopped["threadId"])
        dap.close()
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 1, out[-5000:]
    assert "RewardError: reward for data_source 'polyrl/copy', sample 0" in out
    assert "raised KeyError: 'boxed'" in out and "[polyrl] done" not in out


class RemotePdb:
    """A line-based client of Ray's remote pdb (what ``ray debug`` does on the socket)."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=60)
        self.buf = b""

    def until_prompt(self) -> str:
        while b"(Pdb) " not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"pdb closed the connection; got {self.buf!r}")
            self.buf += data
        text, _, self.buf = self.buf.partition(b"(Pdb) ")
        return text.decode().replace("\r\n", "\n")

    def do(self, command: str) -> str:
        self.sock.sendall(command.encode() + b"\n")
        return self.until_prompt()


@pytest.mark.slow
def test_terminal_debugger_with_ray_debug_legacy(tmp_path):
    """RAY_DEBUG=legacy polyrl train --debug: the conditional breakpoint pauses in Ray's
    remote pdb; the driver's [debug] line gives its address; a socket client reads locals
    with pdb commands and continues; the run completes."""
    proc = start_run(
        tmp_path,
        None,
        "polyrl.RunConfig.total_steps = 2",
        'polyrl.DebugConfig.breakpoints = ["actor.forward if step == 1"]',
        env={**os.environ, "RAY_DEBUG": "legacy"},
    )
    seen: list[str] = []
    try:
        m = wait_for_pause(proc, seen, timeout_s=240)
        role, rank, where, line, host, port = m.groups()
        assert (role, rank) == ("actor", "0") and where.endswith("polyrl/cluster/workers.py"), (
            m.group(0)
        )
        pdb = RemotePdb(host, int(port))
        assert f"workers.py({line})" in pdb.until_prompt()  # where pdb stopped
        assert pdb.do("p step").strip() == "1"
        assert pdb.do("p len(batch), rank").strip() == "(128, 0)"
        pdb.sock.sendall(b"c\n")
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-5000:]
    assert "[debug] Ray's terminal debugger on (RAY_DEBUG=legacy)" in out
    assert "[polyrl] done" in out


@pytest.mark.slow
def test_debug_run_joins_a_cluster_with_token_auth(tmp_path):
    """``RAY_ADDRESS=<head> polyrl train --debug`` on a cluster of its own ``ray start
    --head`` (free port, own temp dir, 3 CPUs, dashboard on 127.0.0.1) with Ray's token
    authentication on (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN): the cluster's dashboard is
    printed, a conditional breakpoint in the actor pauses, the DAP client attaches, and the
    run completes. Only this cluster's processes are stopped (never a global ray stop)."""
    token = secrets.token_hex(32)  # what `ray get-auth-token --generate` writes
    (dashboard,) = _free_ports(1)
    with local_cluster({"CPU": 3}, [], token=token, dashboard_port=dashboard) as address:
        # token auth is on: a driver with another token is refused
        refused = subprocess.run(
            [sys.executable, "-c", "import ray; ray.init()"],
            env=cluster_env(address, secrets.token_hex(32)),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert refused.returncode != 0 and "token" in refused.stderr, refused.stderr[-2000:]
        proc = start_run(
            tmp_path,
            None,
            "polyrl.RunConfig.total_steps = 2",
            'polyrl.DebugConfig.breakpoints = ["actor.forward if step == 1"]',
            env=cluster_env(address, token),
        )
        seen: list[str] = []
        try:
            check = _in_actor_forward("len(batch), rank", "(128, 0)")
            _inspect_and_continue(proc, seen, "actor", check)
            rest, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-5000:]
    assert f"[debug] Ray distributed debugger on; dashboard http://127.0.0.1:{dashboard} " in out
    assert "Connecting to existing Ray cluster" in out  # joined, did not start its own
    assert "[polyrl] done" in out
