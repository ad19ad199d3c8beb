"""`polyrl train --debug` on the tiny model (real vLLM CPU, real Ray): a headless Debug
Adapter Protocol client attaches to a user reward function's breakpoint() in its reward
worker, then to a conditional breakpoint in the actor's forward; a log point in the
rollout server logs without pausing; the run completes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dap_client import DAPClient, wait_for_pause

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.mark.slow
def test_debugger_attaches_to_remote_roles(tmp_path):
    (tmp_path / "dbg_rewards.py").write_text(REWARD)
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "train",
        "--debug",
        "--import",
        "dbg_rewards",
        "--gin_file",
        str(ROOT / "gin/experiments/tiny_grpo.gin"),
    ]
    for b in (
        f"polyrl.RunConfig.run_dir = {str(tmp_path / 'run')!r}",
        "polyrl.RunConfig.total_steps = 3",
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.reward_workers = 1",
        # once per step (train_step runs once per mini-batch: twice a step here)
        'polyrl.DebugConfig.breakpoints = ["actor.forward if step == 1"]',
        'polyrl.DebugConfig.log_points = {"rollout.generate": "len(requests)"}',
    ):
        cmd += ["--gin_param", b]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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

        def in_forward(dap, frame, where, line):
            assert where.endswith("polyrl/workers.py") and frame["line"] == line
            assert dap.local_variables(frame["id"])["step"] == "1"
            assert dap.evaluate("len(batch)", frame["id"]) == "128"  # 16 prompts x n=8

        _inspect_and_continue(proc, seen, "actor", in_forward)
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
