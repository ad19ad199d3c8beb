"""experiments/bench/gsm8k_tool.py's pure parts: the no-sandbox env gives the observation
the sandbox gives for a text that does not compile (hand-written, checked against a real
sandbox run of the same text) and starts no process for it; ``--only``'s names; and the
table of saved runs with issue 46's comparisons under it, hand-computed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.envs.base import Turn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
import gsm8k_tool  # noqa: E402

FAILED = "error: the program exited with status 1\nstderr:\n"
# " a+a+...a+b": 1,202 characters on one line, indented. CPython quotes an error's line
# as read back from main.py in 999-byte pieces, the last piece: characters 999.. of the line
LONG = " " + "a+" * 600 + "b"

CASES = {
    "unclosed": (
        "x = (1,",
        FAILED + '  File "main.py", line 1\n    x = (1,\n        ^\n'
        "SyntaxError: '(' was never closed\n",
    ),
    "crlf, second line": (
        "x = 1\r\ny = (",
        FAILED + '  File "main.py", line 2\n    y = (\n        ^\n'
        "SyntaxError: '(' was never closed\n",
    ),
    "a warning first": (  # the compiler warns at "1if", then fails at the bare "+"
        "x = 1if 2 else 3 +",
        FAILED + "main.py:1: SyntaxWarning: invalid decimal literal\n  x = 1if 2 else 3 +\n"
        '  File "main.py", line 1\n    x = 1if 2 else 3 +\n                      ^\n'
        "SyntaxError: invalid syntax\n",
    ),
    "a NUL byte": (
        "a\x00b",
        FAILED + "SyntaxError: source code string cannot contain null bytes\n",
    ),
    "a long indented line": (
        LONG,
        FAILED + '  File "main.py", line 1\n    ' + "a+" * 101 + "b\n    ^\n"
        "IndentationError: unexpected indent\n",
    ),
}


def _observation(env, text: str) -> list[dict]:
    return env.step(Turn(text, (), 0, "length")).observation


@pytest.fixture(scope="module")
def every_turn():
    """gsm8k_every_turn.py with its two envs registered for this module only: later tests
    see polyrl's registry as the others leave it (validate-config's errors list it)."""
    from polyrl.data.schema import ENV_SOURCES
    from polyrl.envs.base import ENVS

    before = set(ENVS)
    import gsm8k_every_turn

    try:
        yield gsm8k_every_turn
    finally:
        for name in set(ENVS) - before:
            del ENVS[name]
            ENV_SOURCES.discard(name)
        sys.modules.pop("gsm8k_every_turn", None)


@pytest.mark.parametrize("case", list(CASES))
def test_the_no_sandbox_env_observes_what_the_sandbox_prints(case, monkeypatch, every_turn):
    """Both envs' step of one turn, the sandbox's first: the same tool message, written
    out by hand; the no-sandbox env's starts no subprocess."""
    text, content = CASES[case]
    expected = [{"role": "tool", "name": "python", "content": content}]
    assert _observation(every_turn.EveryTurnPython(), text) == expected

    def no_process(*args, **kwargs):
        raise AssertionError(f"a subprocess started: {args[0]!r}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert _observation(every_turn.EveryTurnCompiled(), text) == expected


def test_a_text_that_compiles_gets_an_empty_program_s_output(every_turn):
    """Never run: a program that would print gets what an empty one gets."""
    content = "(no output; print() what you want to see)"
    expected = [{"role": "tool", "name": "python", "content": content}]
    assert _observation(every_turn.EveryTurnCompiled(), "print(1)") == expected
    assert _observation(every_turn.EveryTurnPython(), "") == expected


def test_only_takes_short_names_in_any_order():
    assert gsm8k_tool.only_runs("tool") == ["multi_turn_tool"]
    assert gsm8k_tool.only_runs("tool_nosandbox, single") == [
        "single_turn",
        "multi_turn_nosandbox",
    ]
    with pytest.raises(argparse.ArgumentTypeError) as e:
        gsm8k_tool.only_runs("tool,sandbox")
    assert "unknown run(s) ['sandbox']" in str(e.value)
    assert "single, single_async, tool, tool_nosandbox" in str(e.value)
    with pytest.raises(argparse.ArgumentTypeError, match="names no run"):
        gsm8k_tool.only_runs(" , ")


def _run(tokens_per_s: float, generate_s: float, **more) -> dict:
    return {
        "rollout_tokens_per_s": tokens_per_s,
        "generate_s": generate_s,
        "rollout_limits": {"max_num_seqs": 1024},
        **more,
    }


def test_the_table_of_two_calls_compares_the_runs(tmp_path, capsys):
    """Two files as two device calls would write them; the tool run's latency shows, the
    single-turn runs have none ('-'); 15000 / 20000 = 0.75x, 18000 / 20000 = 0.90x, the
    sandbox (30 - 24) s = 20.0% of the tool run's 30 s."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(
        json.dumps(
            {
                "model": "m",
                "single_turn_async": _run(20000.0, 13.1),
                "multi_turn_tool": _run(15000.0, 30.0, tool_latency_s=0.25),
            }
        )
    )
    second.write_text(
        json.dumps(
            {
                "model": "m",
                "multi_turn_nosandbox": _run(18000.0, 24.0, tool_latency_s=0.001),
                "single_turn": _run(28000.0, 9.4),
            }
        )
    )
    out = gsm8k_tool.main(["--table", str(first), str(second), "--json", str(tmp_path / "c")])
    printed = capsys.readouterr().out.splitlines()
    header = printed[0].split()
    assert header == ["single-turn", "single-turn", "(async)", "multi-turn+tool"] + [
        "multi-turn,",
        "no",
        "sandbox",
    ]
    latency = next(line for line in printed if line.startswith("tool_latency_s"))
    assert latency.split() == ["tool_latency_s", "-", "-", "0.250", "0.001"]
    assert printed[-3:] == [
        "multi-turn / single-turn, same engine: 0.75x (goal >= 0.9)",
        "multi-turn without the sandbox / single-turn, same engine: 0.90x",
        "sandbox's share of generate: (30.00 - 24.00) s = 20.0%",
    ]
    saved = json.loads((tmp_path / "c").read_text())
    assert saved["comparisons"] == out["comparisons"]
    assert saved["comparisons"]["sandbox_s"] == pytest.approx(6.0)
    assert saved["comparisons"]["tool_over_single_async"] == pytest.approx(0.75)


@pytest.mark.slow
def test_the_cpu_smoke_run_of_the_docs_runs_the_four(tmp_path):
    """docs/agents.md's CPU smoke commands as written (the tiny model in tmp_path, a
    --json added): the four runs, 8 prompts x 4 samples x 16 tokens sampled by each
    single-turn run, a tool call in every multi-turn episode (each first turn is one),
    and the three comparisons. 2-5 minutes on 2 cores."""
    import os
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    smoke = doc.split("A CPU smoke run on the tiny model:", 1)[1].split("\n\n", 1)[0]
    make, bench = (" ".join(c.split()) for c in re.findall(r"`([^`]+)`", smoke))
    assert make == "polyrl make-tiny /tmp/tiny", make
    saved = tmp_path / "out.json"
    script = f"{make} >/dev/null && {bench} --json {saved}".replace("/tmp/tiny", str(tmp_path))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(saved.read_text())
    for name in ("single_turn", "single_turn_async"):
        assert out[name]["sampled_tokens"] == 8 * 4 * 16
    for name in ("multi_turn_tool", "multi_turn_nosandbox"):
        assert out[name]["tool_calls_mean"] >= 1.0
    assert sorted(out["comparisons"]) == [
        "nosandbox_over_single_async",
        "sandbox_s",
        "sandbox_share_of_generate",
        "tool_over_single_async",
    ]
