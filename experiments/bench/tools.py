"""Benchmark: what tool calls cost an episode's turn (docs/agents.md).

- ``parse``: ``parse_tool_calls`` on a turn with two Hermes calls;
- ``run_tool_calls``: one call of a no-op tool (schema check, a thread per call, the
  join), against calling the function directly; and eight calls, four at a time;
- ``calculator``: one call of the built-in calculator through ``run_tool_calls``;
- ``sandbox``: one ``run_python`` (a fresh interpreter, namespaces, limits, its
  directory made and removed) for ``print(1 + 1)`` and for a program importing numpy,
  one at a time, and ``--threads`` at once (runs per second).

Prints a table, then one JSON object (also written to --out)::

    python experiments/bench/tools.py --repeat 50 --sandbox-repeat 20 --threads 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from polyrl.envs.parsers import parse_tool_calls
from polyrl.envs.sandbox import run_python
from polyrl.envs.tools import TOOLS, Tool, ToolCall, run_tool_calls

TURN = (
    "I will compute both.\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(17 + 4) * 3"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}\n</tool_call>'
)
NOOP = Tool(
    "noop",
    "returns ok",
    {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    lambda x: "ok",
)


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=50, help="timed repeats of the fast cases")
    ap.add_argument("--sandbox-repeat", type=int, default=20, help="timed sandbox runs per case")
    ap.add_argument("--threads", type=int, default=4, help="concurrent sandbox runs")
    ap.add_argument("--out", default="tools_bench.json")
    args = ap.parse_args()

    tools = {"noop": NOOP, **TOOLS}
    one = [ToolCall("noop", {"x": 1}, "")]
    eight = one * 8
    calc = [ToolCall("calculator", {"expression": "(17 + 4) * 3 / 7"}, "")]
    for code in ("print(1 + 1)", "import numpy"):  # warm the page cache
        run_python(code)
    result = {
        "parse_us": 1e6 * median_s(lambda: parse_tool_calls(TURN), args.repeat),
        "noop_direct_us": 1e6 * median_s(lambda: NOOP.fn(x=1), args.repeat),
        "noop_call_us": 1e6 * median_s(lambda: run_tool_calls(one, tools), args.repeat),
        "noop_8_calls_us": 1e6
        * median_s(lambda: run_tool_calls(eight, tools, max_concurrency=4), args.repeat),
        "calculator_call_us": 1e6 * median_s(lambda: run_tool_calls(calc, tools), args.repeat),
        "sandbox_print_ms": 1e3 * median_s(lambda: run_python("print(1 + 1)"), args.sandbox_repeat),
        "sandbox_numpy_ms": 1e3
        * median_s(
            lambda: run_python("import numpy; print(numpy.arange(4).sum())"), args.sandbox_repeat
        ),
    }
    n = args.sandbox_repeat * args.threads
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(lambda _: run_python("print(1 + 1)"), range(n)))
    result["sandbox_runs_per_s"] = n / (time.perf_counter() - t0)
    result["threads"] = args.threads
    probe = run_python("print(1)")
    result["network_isolated"] = probe.network_isolated
    result["pid_namespace"] = probe.pid_namespace
    result["proc_isolated"] = probe.proc_isolated

    for key, value in result.items():
        print(f"{key:24s} {value:.1f}" if isinstance(value, float) else f"{key:24s} {value}")
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
