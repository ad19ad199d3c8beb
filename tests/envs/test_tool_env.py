"""ToolEnv: a turn's tool calls run and come back as tool messages; malformed calls and
failing or hanging tools become error observations, counted, never raised; the env's
tools and parser are checked by validate-config (``env_problems``)."""

from __future__ import annotations

import threading
import time

import pytest

from polyrl.envs import ENVS, StepResult, ToolEnv, Turn, env_problems, register_env
from polyrl.envs.tasks import CalcEnv, arithmetic_calls
from polyrl.envs.tools import CALCULATOR, Tool

RELEASE = threading.Event()  # lets the hanging tool's thread end after the test


def _hang(seconds: float) -> str:
    RELEASE.wait(seconds)
    return "late"


HANG = Tool(
    "hang",
    "Sleeps.",
    {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    _hang,
    timeout_s=0.3,
)


class Desk(ToolEnv):
    tools = (CALCULATOR, HANG)
    tool_parser = "hermes"

    def answer(self, turn):
        return StepResult(reward=float(turn.text.strip() == "42"), done=True)


def _turn(text: str, index: int = 0) -> Turn:
    return Turn(text, (), index, "stop")


def _call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_calls_run_and_errors_come_back_as_tool_messages():
    env = Desk()
    env.reset({"prompt": [{"role": "user", "content": "6*7?"}]})
    turn = _turn(
        _call("calculator", '{"expression": "6*7"}')
        + _call("calculator", '{"expression": "6/0"}')
        + "<tool_call>{not json</tool_call>"
    )
    out = env.step(turn)
    assert not out.done and out.reward == 0.0
    assert [m["role"] for m in out.observation] == ["tool"] * 3
    assert out.observation[0]["content"] == "42"
    assert "division by zero" in out.observation[1]["content"]
    assert out.observation[2]["content"].startswith("error: ")  # the malformed call
    assert out.info["tool_calls"] == 3 and out.info["tool_errors"] == 2
    assert env.step(_turn("42", 1)) == StepResult(reward=1.0, done=True)


def test_a_hanging_tool_is_cut_at_its_timeout():
    env = Desk()
    t0 = time.perf_counter()
    try:
        out = env.step(_turn(_call("hang", '{"seconds": 30}')))
    finally:
        RELEASE.set()
    assert time.perf_counter() - t0 < 5  # the tool's 0.3 s, not its 30 s
    assert out.info == pytest.approx(
        {"tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.3}, abs=0.2
    )
    assert "0.3" in out.observation[0]["content"]


def _slow() -> str:
    time.sleep(0.3)
    return "done"


class Slow(ToolEnv):
    tools = (Tool("slow", "Sleeps 0.3 s.", {"type": "object", "properties": {}}, _slow, 0.05),)


def test_under_debug_a_tool_is_not_cut_at_its_timeout(monkeypatch):
    """In a process under --debug (setup_worker found the config) ToolEnv waits for a
    tool past its timeout_s: a tool paused at a breakpoint is not cut."""
    from polyrl.observe import debug

    turn = _turn(_call("slow", "{}"))
    assert "0.05" in Slow().step(turn).observation[0]["content"]  # cut at 0.05 s
    monkeypatch.setitem(debug._state, "config", debug.DebugConfig(enabled=True))
    out = Slow().step(turn)
    assert out.observation[0]["content"] == "done" and out.info["tool_errors"] == 0


def test_calc_env_rewards_the_answer_and_a_call_that_found_it():
    row = {"prompt": [{"role": "user", "content": "37*8-291"}], "ground_truth": "5"}
    env = CalcEnv()
    env.reset(row)
    call = env.step(_turn(" =7"))  # a turn starting with "=" evaluates the question
    assert call.observation == [{"role": "tool", "name": "calculator", "content": "5"}]
    assert call.reward == 0.0 and not call.done and call.info["tool_calls"] == 1
    assert env.step(_turn("5", 1)) == StepResult(reward=1.2, done=True)  # 1 + 0.2 for the call
    env.reset(row)
    assert env.step(_turn("5")) == StepResult(reward=1.0, done=True)  # no call: no 0.2
    env.reset(row)
    assert env.step(_turn("37*8")).observation[0]["content"] == "296"  # a typed expression
    assert env.step(_turn("52", 1)) == StepResult(reward=0.5, done=True)  # 1 of 2 chars; no 0.2
    assert env.step(_turn("=", 0)).reward == 0.0 and env.step(_turn("==", 1)).reward == 0.0
    assert arithmetic_calls("1665").calls == [] and arithmetic_calls("3+").calls == []


def test_env_problems_name_bad_tools_and_parsers():
    bad = Tool("bad name", "", {"type": "object"}, lambda: "x")

    @register_env("test/bad_tools")
    class BadTools(ToolEnv):
        tools = (bad,)
        tool_parser = "hermez"

    try:
        problems = env_problems("test/bad_tools")
    finally:
        del ENVS["test/bad_tools"]
    assert any("tool 'bad name': name must be" in p for p in problems)
    assert any("tool_parser='hermez' is not a registered parser" in p for p in problems)
    assert any("did you mean 'hermes'" in p for p in problems)
    assert env_problems("polyrl/calc") == [] and env_problems("polyrl/guess") == []


def test_writing_an_environment_examples_run():
    """docs/agents.md "Writing an environment": its examples register and play."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    section = text.split("## Writing an environment\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    try:
        for block in blocks:
            exec(compile(block, "docs/agents.md", "exec"), {})
        row = {"prompt": [{"role": "user", "content": "6*7"}], "ground_truth": "42"}
        countdown, arithmetic = ENVS["my/countdown"](), ENVS["my/arithmetic"]()
        countdown.reset(row)
        assert countdown.step(_turn("41")).observation == [{"role": "user", "content": "no"}]
        assert countdown.step(_turn("42")).done
        arithmetic.reset(row)
        assert (
            arithmetic.step(_turn(_call("calculator", '{"expression": "6*7"}'))).info["tool_calls"]
            == 1
        )
        assert arithmetic.step(_turn("42")).reward == 1.0
    finally:
        ENVS.pop("my/countdown", None)
        ENVS.pop("my/arithmetic", None)
