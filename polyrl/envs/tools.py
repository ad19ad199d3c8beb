"""Tools a model may call: declared by JSON schema, registered by name, run with limits.

A :class:`Tool` is a name, a description, a JSON schema of its arguments and a Python
function returning text. ``tool.schema()`` is what a chat template takes
(``tokenizer.apply_chat_template(messages, tools=[t.schema() for t in tools])``).
:func:`run_tool_calls` runs the calls parsed from one model turn (``polyrl.envs.parsers``)
a few at a time, each with its tool's timeout, and never raises for a tool's fault: an
exception, a timeout, an unknown tool or arguments that do not match the schema become an
error :class:`ToolResult` whose ``content`` is the text the model sees.

Built-in tools (registered at import): ``calculator`` (arithmetic evaluated over the
``ast``, never ``eval``) and ``python`` (code run in ``polyrl.envs.sandbox``).
"""

from __future__ import annotations

import ast
import asyncio
import collections
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import operator
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonschema

from polyrl.envs import sandbox

__all__ = [
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolError",
    "TOOLS",
    "REASONS",
    "register_tool",
    "get_tool",
    "registered_tools",
    "tool_problems",
    "run_tool_calls",
    "arun_tool_calls",
    "calculate",
    "python_tool",
    "unknown_name",
]

# ToolResult.reason values (None: the tool returned normally); "malformed" is a call the
# parser could not read (ParseResult.error_results), the others come from run_tool_calls.
REASONS = ("timeout", "exception", "unknown_tool", "bad_arguments", "limit", "malformed")

# OpenAI's rule for function names, which chat templates and parsers assume.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call. ``parameters`` is the JSON schema (type "object") of
    its arguments; ``fn`` is called with them as keywords and returns the text result (or
    raises; :class:`ToolError` for a message meant for the model). ``timeout_s`` bounds one
    call: past it the call becomes a "timeout" error result (a Python function cannot be
    stopped, so it runs on in a daemon thread; tools that may hang should run a
    subprocess they can kill, as ``python`` does)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]
    timeout_s: float = 10.0

    def schema(self) -> dict:
        """The OpenAI function-tool form that ``apply_chat_template(tools=[...])`` takes."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


class ToolError(Exception):
    """Raised by a tool's function: the call fails with exactly this message for the model
    (no exception type or traceback)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call parsed from a model turn; ``raw`` is its text in the turn."""

    name: str
    arguments: Mapping[str, Any]
    raw: str


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one call. ``content`` is what the model sees (the tool's text, or the
    error). ``reason``: None (success) or one of :data:`REASONS`."""

    name: str
    content: str
    error: bool
    seconds: float
    reason: str | None

    def message(self) -> dict:
        """The ``tool`` chat message that returns this result to the model."""
        return {"role": "tool", "name": self.name, "content": self.content}


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    """Register ``tool`` under its name (the names environments and configs use).
    Registering the same tool again is a no-op; another tool under a taken name is an error."""
    problems = tool_problems([tool])
    if problems:
        raise ValueError("cannot register tool: " + "; ".join(problems))
    if tool.name in TOOLS and TOOLS[tool.name] is not tool:
        raise ValueError(
            f"a tool named {tool.name!r} is already registered ({_origin(TOOLS[tool.name])}); "
            "give the new one another name"
        )
    TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    try:
        return TOOLS[name]
    except KeyError:
        raise ValueError(
            unknown_name("tool", name, TOOLS) + " Register it with register_tool(Tool(...))."
        ) from None


def registered_tools() -> list[str]:
    return sorted(TOOLS)


def unknown_name(kind: str, name: str, known: Mapping[str, Any]) -> str:
    """The error for a name not in a registry: the closest registered name, and all of them."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r}.{hint} Known: {sorted(known)}."


def _origin(tool: Tool) -> str:
    fn = tool.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def tool_problems(tools: Sequence[Tool]) -> list[str]:
    """Everything wrong with a set of tools offered together, one message per problem
    naming the tool, the field and the fix (empty: fine). Checked: the name (what chat
    templates accept), duplicates, the description, the parameters schema (a valid JSON
    schema of type "object", its ``required`` names among its ``properties``), the
    function (callable, accepting the schema's properties as keywords, needing none
    the schema does not require) and the timeout."""
    out: list[str] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            out.append(f"tools[{i}] is a {type(tool).__name__}, not a polyrl.envs.tools.Tool")
            continue
        who = f"tool {tool.name!r}"
        if not isinstance(tool.name, str) or not _NAME.match(tool.name):
            out.append(
                f"{who}: name must be 1-64 letters, digits, '_' or '-' (chat templates and "
                "tool-call parsers assume it); rename it"
            )
        elif tool.name in seen:
            out.append(f"{who}: name offered twice; each tool offered together needs its own name")
        seen.add(tool.name)
        if not isinstance(tool.description, str) or not tool.description.strip():
            out.append(f"{who}: description is empty; say what the tool does and returns")
        schema_problems = _schema_problems(tool.parameters)
        out.extend(f"{who}: {p}" for p in schema_problems)
        # The function is held against the schema only once the schema itself is sound.
        out.extend(f"{who}: {p}" for p in _fn_problems(tool, against_schema=not schema_problems))
        t = tool.timeout_s
        if (
            isinstance(t, bool)
            or not isinstance(t, int | float)
            or not (t > 0 and math.isfinite(t))
        ):
            out.append(f"{who}: timeout_s={t!r}; give a positive number of seconds")
    return out


def _schema_problems(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return [
            f"parameters is a {type(schema).__name__}; give a JSON schema dict with type 'object'"
        ]
    if schema.get("type") != "object":
        return [
            f"parameters has type {schema.get('type')!r}; tool arguments are a JSON object: "
            "give {'type': 'object', 'properties': {...}}"
        ]
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top)"
        return [f"parameters is not a valid JSON schema at {where}: {e.message}"]
    props = schema.get("properties", {})
    missing = [r for r in schema.get("required", []) if r not in props]
    if missing:
        return [f"parameters.required names {missing}, which are not in parameters.properties"]
    return []


def _fn_problems(tool: Tool, against_schema: bool) -> list[str]:
    if not callable(tool.fn):
        return [f"fn is a {type(tool.fn).__name__}, not callable"]
    try:
        params = inspect.signature(tool.fn).parameters.values()
    except (TypeError, ValueError):
        return []  # a builtin without a signature: trust it
    if not against_schema:
        return []
    props = set(tool.parameters.get("properties", {}))
    required = set(tool.parameters.get("required", []))
    kinds = {p.kind for p in params}
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    out = []
    if inspect.Parameter.VAR_KEYWORD not in kinds and props - names:
        out.append(
            f"fn {_origin(tool)} takes no keyword argument {sorted(props - names)} of "
            "parameters.properties; add them to its signature (or **kwargs)"
        )
    needed = {
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    if needed - required:
        out.append(
            f"fn {_origin(tool)} needs {sorted(needed - required)}, which parameters.required "
            "does not list (a call without them would fail); require them or give defaults"
        )
    return out


def _argument_problems(tool: Tool, arguments: Mapping[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(tool.parameters)
    problems = [
        (f"{'/'.join(map(str, e.absolute_path))}: " if e.absolute_path else "") + e.message
        for e in sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    ]
    if not problems:
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as e:
            problems.append(str(e))
        except ValueError:
            pass  # no signature to check against
    return problems


def _error(name: str, content: str, start: float, reason: str) -> ToolResult:
    return ToolResult(name, "error: " + content, True, time.monotonic() - start, reason)


def _checked(call: ToolCall, tools: Mapping[str, Tool]) -> tuple[Tool, dict] | ToolResult:
    """The tool and the arguments to call it with, or the error result of a call that
    cannot run (unknown tool, arguments that break the schema or the signature)."""
    start = time.monotonic()
    tool = tools.get(call.name)
    if tool is None:
        return _error(call.name, unknown_name("tool", call.name, tools), start, "unknown_tool")
    args = dict(call.arguments) if isinstance(call.arguments, Mapping) else call.arguments
    if not isinstance(args, dict):
        problems = [f"arguments are a {type(args).__name__}, not a JSON object"]
    else:
        try:
            problems = _argument_problems(tool, args)
        except Exception as e:  # the tool's schema, not the call: e.g. an unresolvable $ref
            text = f"tool {call.name!r} could not check its arguments: {type(e).__name__}: {e}"
            return _error(call.name, text, start, "exception")
    if problems:
        text = f"bad arguments for tool {call.name!r}: " + "; ".join(problems)
        return _error(call.name, text, start, "bad_arguments")
    return tool, args


def _start(tool: Tool, args: dict, box: dict, done: Callable[[], None]) -> float:
    """Run ``tool.fn(**args)`` on a daemon thread of its own, its value or exception into
    ``box``, then ``done()``; returns the start time."""

    def target() -> None:
        try:
            box["value"] = tool.fn(**args)
        except BaseException as e:  # noqa: BLE001 (a tool's fault is the model's observation)
            box["error"] = e
        with contextlib.suppress(RuntimeError):  # the waiting event loop closed meanwhile
            done()

    start = time.monotonic()
    threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True).start()
    return start


def _outcome(name: str, box: dict, start: float) -> ToolResult:
    if "error" in box:
        e = box["error"]
        text = (
            str(e) if isinstance(e, ToolError) else f"tool {name!r} failed: {type(e).__name__}: {e}"
        )
        return _error(name, text, start, "exception")
    value = box["value"]
    if not isinstance(value, str):
        text = f"tool {name!r} returned a {type(value).__name__}, not text"
        return _error(name, text, start, "exception")
    return ToolResult(name, value, False, time.monotonic() - start, None)


def _late(name: str, tool: Tool, box: dict, start: float) -> ToolResult:
    """The result of a call whose time ran out: a timeout, unless it finished just then."""
    if box:
        return _outcome(name, box, start)
    return _error(name, f"tool {name!r} timed out after {tool.timeout_s:g} s", start, "timeout")


def _budget(calls: Sequence[ToolCall], max_concurrency: int, max_calls: int | None) -> int:
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}: give at least 1")
    return len(calls) if max_calls is None else max(0, min(len(calls), max_calls))


def _over_limit(calls: Sequence[ToolCall], max_calls: int | None) -> list[ToolResult]:
    now = time.monotonic()
    text = f"tool call limit reached ({max_calls} calls); this call was not run"
    return [_error(call.name, text, now, "limit") for call in calls]


def run_tool_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    *,
    max_concurrency: int = 4,
    max_calls: int | None = None,
    timeouts: bool = True,
) -> list[ToolResult]:
    """Run ``calls`` against ``tools`` (name -> Tool), at most ``max_concurrency`` at once,
    in order of the calls; one result per call, in that order. Calls past ``max_calls``
    (the episode's remaining budget; None: no limit) are not run: they get a "limit" error
    result. Never raises for a tool's fault.

    Each call runs on a daemon thread of its own, timed from its start: at its tool's
    ``timeout_s`` it becomes a "timeout" result and its slot goes to the next call (the
    function cannot be stopped and runs on unseen; a daemon thread never holds up the
    interpreter's exit). ``timeouts=False`` waits for every call however long it takes:
    for debugging, so that a tool paused at a breakpoint is not cut while you step
    through it. :func:`arun_tool_calls` is the same for an asyncio event loop."""
    budget = _budget(calls, max_concurrency, max_calls)
    results: list[ToolResult | None] = [None] * budget
    waiting: collections.deque[tuple[int, Tool, dict]] = collections.deque()
    for i, call in enumerate(calls[:budget]):
        checked = _checked(call, tools)
        if isinstance(checked, ToolResult):
            results[i] = checked
        else:
            waiting.append((i, *checked))
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()
    running: dict[int, tuple[float, Tool, float, dict]] = {}  # i -> (deadline, tool, start, box)
    while waiting or running:
        while waiting and len(running) < max_concurrency:
            i, tool, args = waiting.popleft()
            box: dict[str, Any] = {}
            start = _start(tool, args, box, functools.partial(finished.put, i))
            running[i] = (start + tool.timeout_s if timeouts else math.inf, tool, start, box)
        first = min(deadline for deadline, *_ in running.values())
        with contextlib.suppress(queue.Empty):
            done = finished.get(
                timeout=None if first == math.inf else max(0.0, first - time.monotonic())
            )
            if done in running:
                _, _, start, box = running.pop(done)
                results[done] = _outcome(calls[done].name, box, start)
        now = time.monotonic()
        for i in [i for i, (deadline, *_) in running.items() if deadline <= now]:
            _, tool, start, box = running.pop(i)
            results[i] = _late(calls[i].name, tool, box, start)
    return [*results, *_over_limit(calls[budget:], max_calls)]  # type: ignore[list-item]


async def arun_tool_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    *,
    max_concurrency: int = 4,
    max_calls: int | None = None,
    timeouts: bool = True,
) -> list[ToolResult]:
    """:func:`run_tool_calls` for an asyncio event loop (an environment with many episodes
    in flight): the same results, the loop free while the calls run."""
    budget = _budget(calls, max_concurrency, max_calls)
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(max_concurrency)  # FIFO: calls start in order

    async def one(call: ToolCall) -> ToolResult:
        checked = _checked(call, tools)
        if isinstance(checked, ToolResult):
            return checked
        tool, args = checked
        async with slots:
            box: dict[str, Any] = {}
            finished = asyncio.Event()
            start = _start(
                tool, args, box, functools.partial(loop.call_soon_threadsafe, finished.set)
            )
            try:
                await asyncio.wait_for(finished.wait(), tool.timeout_s if timeouts else None)
            except TimeoutError:
                return _late(call.name, tool, box, start)
            return _outcome(call.name, box, start)

    results = await asyncio.gather(*(one(call) for call in calls[:budget]))
    return [*results, *_over_limit(calls[budget:], max_calls)]


# --- calculator ------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CHARS = 1000
_MAX_BITS = 4096  # integers past this are refused before they are computed (9**9**9 would hang)
_MAX_DEPTH = 100  # our own bound: Python's recursion limit differs between processes
_SYMBOLS = "numbers, + - * / // % ** and parentheses"


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression over the ``ast`` (numbers, ``+ - * / // % **``,
    unary ``+``/``-``, parentheses). Anything else -- names, calls, attributes,
    strings -- is refused with ValueError; so are integers over 4096 bits and expressions
    nested over 100 deep."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"expression longer than {_MAX_CHARS} characters")
    try:
        return _eval(ast.parse(expression.strip(), mode="eval").body, 0)
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg}); use {_SYMBOLS}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression nested too deeply") from None


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > _MAX_DEPTH:
        raise ValueError(f"expression nested too deeply (over {_MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        _check_size(node.op, a, b)
        try:
            value = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        if isinstance(value, complex):
            raise ValueError("result is a complex number (a negative number to a fractional power)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("result too large")
        return value
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"{type(node.value).__name__} constant"
    raise ValueError(f"{what} is not allowed; the calculator takes {_SYMBOLS}")


def _check_size(op: ast.operator, a: int | float, b: int | float) -> None:
    if not (isinstance(a, int) and isinstance(b, int)):
        return  # floats overflow to an OverflowError, which is caught
    bits = abs(a).bit_length()
    if isinstance(op, ast.Pow) and bits > 1 and b > 0:
        estimate = bits * b  # an upper bound of the result's bits
    elif isinstance(op, ast.Mult):
        estimate = bits + abs(b).bit_length()
    else:
        return
    if estimate > _MAX_BITS:
        raise ValueError(f"result too large (over {_MAX_BITS} bits)")


def _calculator(expression: str) -> str:
    try:
        value = calculate(expression)
    except ValueError as e:
        raise ToolError(f"calculator: {e}") from None
    # 12 significant digits: 0.1 + 0.2 reads 0.3 and 6 / 3 reads 2, as a person writes them.
    return str(value) if isinstance(value, int) else format(value, ".12g")


CALCULATOR = register_tool(
    Tool(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses. "
            "Returns the value."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "for example (3 + 4) * 12 / 7"}
            },
            "required": ["expression"],
        },
        fn=_calculator,
        timeout_s=5.0,
    )
)


# --- python ----------------------------------------------------------------------------


def python_tool(
    limits: sandbox.SandboxLimits = sandbox.SandboxLimits(),  # noqa: B008 (frozen)
    name: str = "python",
) -> Tool:
    """A tool that runs the model's program in the sandbox under ``limits`` and returns
    what it printed; a failure or a limit is an error result naming it, with the output
    so far. The registered ``python`` tool is ``python_tool()``; register another under
    its own name for other limits."""
    problems = limits.problems()
    if problems:
        raise ValueError(f"python_tool({name!r}): " + "; ".join(problems))

    def run(code: str) -> str:
        result = sandbox.run_python(code, limits)
        if result.reason is None and result.exit_code == 0:
            return result.stdout or "(no output; print() what you want to see)"
        raise ToolError(_python_failure(result, limits))

    return Tool(
        name=name,
        description=(
            "Run a Python program in a fresh interpreter and return what it prints "
            "(print the values you need). Each call starts from nothing."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the complete program"}},
            "required": ["code"],
        },
        fn=run,
        # The sandbox stops the program at wall_s itself and says which limit it hit;
        # this outer limit only covers starting and cleaning up.
        timeout_s=limits.wall_s + 5.0,
    )


def _python_failure(result: sandbox.SandboxResult, limits: sandbox.SandboxLimits) -> str:
    stopped = {
        "timeout": f"the program was stopped at its time limit of {limits.wall_s:g} s",
        "cpu": f"the program was stopped at its CPU-time limit of {limits.cpu_s:g} s",
        "memory": f"the program went over its memory limit of {limits.memory_mb} MB",
        "output": f"the program was stopped: its output passed {limits.max_output_bytes} bytes",
        "error": "the program could not run or crashed",
        None: f"the program exited with status {result.exit_code}",
    }[result.reason]
    parts = [stopped]
    if result.stdout:
        parts.append("stdout:\n" + result.stdout)
    if result.stderr:
        parts.append("stderr:\n" + result.stderr)
    return "\n".join(parts)


PYTHON = register_tool(python_tool())
