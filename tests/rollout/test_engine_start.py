"""A server's engine start against GPU memory that other processes release meanwhile
(polyrl.rollout.engine_start): which failures are that race, the wait for quiet GPU
memory, and the retries. The GPU run of the race itself is test_gpu_engine_start.py.

The failures are vLLM's own messages, read from the installed vLLM's source; the GPUs'
free memory is a reader that ``start_engine`` and ``wait_quiet`` take as a parameter.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path

import pytest

from polyrl.rollout.engine_start import describe, profiling_race, start_engine, wait_quiet

GIB = 2**30


def vllm_message(module: str, phrase: str) -> str:
    """The text of the installed vLLM's exception message (an ``assert``'s or a ``raise``'s)
    that contains ``phrase``, with each formatted value written as 70.5."""
    spec = importlib.util.find_spec("vllm")
    path = Path(next(iter(spec.submodule_search_locations)), *module.split("."))
    tree = ast.parse(path.with_suffix(".py").read_text())

    def text(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) for v in node.values)
        if isinstance(node, ast.BinOp):
            return text(node.left) + text(node.right)
        return "70.5"

    found = [
        text(n)
        for n in ast.walk(tree)
        if isinstance(n, (ast.JoinedStr, ast.BinOp)) and phrase in text(n)
    ]
    assert found, f"no message with {phrase!r} in vllm.{module}"
    return max(found, key=len)


RACE = vllm_message("v1.worker.gpu_worker", "Error in memory profiling")


class Clock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def reader(clock: Clock, events: list[tuple[float, float]], start_gib: float = 70.0):
    """Free GiB of one GPU over time: ``events`` are (time, change in free GiB)."""
    return lambda: (int((start_gib + sum(d for t, d in events if clock.t >= t)) * GIB),)


def test_the_race_is_vllms_profiling_assertion_and_nothing_else():
    assert "release GPU memory while vLLM is profiling" in RACE
    assert profiling_race(AssertionError(RACE))
    # as an in-process vllm.LLM raises it, from deep inside its start
    try:
        try:
            raise AssertionError(RACE)
        except AssertionError as e:
            raise RuntimeError("engine start failed") from e
    except RuntimeError as wrapped:
        assert profiling_race(wrapped)
    # vLLM's other start-up failure on a full GPU is not the race by its text
    too_full = vllm_message("v1.worker.utils", "on startup")
    assert not profiling_race(ValueError(too_full))
    assert not profiling_race(RuntimeError("Engine core initialization failed."))


def test_wait_quiet_waits_out_releases_but_not_allocations():
    clock = Clock()
    # another process takes 3 GiB at 0.3 s: the wait ends after quiet_s all the same
    got = wait_quiet(reader(clock, [(0.3, -3)]), 1.0, 30.0, 0.1, clock, clock.sleep)
    assert got == (67 * GIB,) and clock.t == pytest.approx(1.0, abs=0.11)
    clock = Clock()
    # it releases 4 GiB at 0.5 s: quiet from then on
    got = wait_quiet(reader(clock, [(0.5, 4)]), 1.0, 30.0, 0.1, clock, clock.sleep)
    assert got == (74 * GIB,) and clock.t == pytest.approx(1.5, abs=0.11)
    clock = Clock()
    # a release every 0.4 s forever: the wait gives up at its timeout
    churn = [(0.4 * k, 4 if k % 2 else -4) for k in range(1, 100)]
    wait_quiet(reader(clock, churn), 1.0, 5.0, 0.1, clock, clock.sleep)
    assert clock.t == pytest.approx(5.0, abs=0.11)
    # no GPU: no wait
    clock = Clock()
    assert wait_quiet(tuple, 1.0, 30.0, 0.1, clock, clock.sleep) == ()
    assert clock.t == 0


class Starts:
    """``build`` for start_engine: raises ``errors`` in turn (each after ``events`` change
    the GPU's free memory), then returns "engine"; each call takes ``build_s``."""

    def __init__(
        self, clock: Clock, errors: list[Exception], release_gib: float = 0.0, build_s=0.0
    ):
        self.clock, self.errors, self.calls = clock, list(errors), 0
        self.events: list[tuple[float, float]] = []
        self.release_gib, self.build_s = release_gib, build_s

    def __call__(self) -> str:
        self.calls += 1
        self.clock.sleep(self.build_s)
        if self.release_gib:  # another process releases memory during this start
            self.events.append((self.clock.t, self.release_gib))
        if self.errors:
            raise self.errors.pop(0)
        return "engine"


def start(
    starts: Starts,
    clock: Clock,
    retries: int = 2,
    cleanups: list | None = None,
    record: dict | None = None,
):
    return start_engine(
        starts,
        reader(clock, starts.events),
        "rollout server 3",
        cleanup=lambda: (cleanups if cleanups is not None else []).append(1),
        retries=retries,
        record=record,
        quiet_s=1.0,
        timeout_s=30.0,
        interval_s=0.1,
        clock=clock,
        sleep=clock.sleep,
    )


def test_a_start_that_vllm_says_raced_is_retried_with_a_named_line(caplog):
    clock, cleanups = Clock(), []
    starts = Starts(clock, [AssertionError(RACE)])
    with caplog.at_level(logging.WARNING, "polyrl.rollout.engine_start"):
        assert start(starts, clock, cleanups=cleanups) == "engine"
    assert starts.calls == 2 and cleanups == [1]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("rollout server 3: the engine failed to start while another process")
    assert "retrying (1/2)" in line


def test_a_start_that_failed_while_free_memory_grew_is_retried():
    # the asynchronous engine's core is a process of its own: its error reaches the
    # server as "Engine core initialization failed"; the 4 GiB freed meanwhile name it
    clock = Clock()
    starts = Starts(clock, [RuntimeError("Engine core initialization failed.")], release_gib=4)
    assert start(starts, clock) == "engine" and starts.calls == 2


def test_other_failures_are_raised_at_once():
    clock = Clock()
    bad = ValueError("max_model_len=99999 is larger than the model's")
    starts = Starts(clock, [bad])
    with pytest.raises(ValueError) as raised:
        start(starts, clock)
    assert raised.value is bad and starts.calls == 1


def test_a_race_on_every_start_ends_in_an_error_that_names_it():
    clock = Clock()
    starts = Starts(clock, [AssertionError(RACE)] * 3, release_gib=2)
    with pytest.raises(RuntimeError, match="rollout server 3: its engine failed to start 3 times"):
        start(starts, clock)
    assert starts.calls == 3


def test_the_start_records_its_wait_its_engine_time_and_its_starts():
    clock, times = Clock(), {}
    starts = Starts(clock, [AssertionError(RACE)], build_s=5.0)
    starts.events.append((0.5, 4))  # a run just ended frees 4 GiB at 0.5 s
    assert start(starts, clock, record=times) == "engine"
    # waits (quiet_s 1.0): 0-1.5 s (quiet from the release on), after the failed start
    # 6.5-7.5 s, before the second 7.5-8.5 s; two builds of 5 s each
    assert times["engine_starts"] == 2 and times["engine_s"] == pytest.approx(10.0)
    assert times["memory_wait_s"] == pytest.approx(3.5, abs=0.35)
    assert clock.t == pytest.approx(13.5, abs=0.35)
    line = describe(times)
    assert line.startswith("vLLM engine 10.0 s, 2 starts, ") and "s waiting for GPU memory" in line
    # a start on the CPU (no GPU memory to read): no wait, one start, only the engine named
    clock, times = Clock(), {}
    start_engine(Starts(clock, [], build_s=2.0), tuple, "s", record=times, clock=clock)
    assert times == {"memory_wait_s": 0.0, "engine_s": 2.0, "engine_starts": 1}
    assert describe(times) == "vLLM engine 2.0 s"
