"""Tools: schemas in a real chat template, the registry, validation, running calls with
timeouts and concurrency, and the built-in calculator and python tools."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from polyrl.data.tiny import build_tokenizer
from polyrl.envs.parsers import parse_tool_calls
from polyrl.envs.sandbox import SandboxLimits
from polyrl.envs.tools import (
    TOOLS,
    Tool,
    ToolCall,
    ToolError,
    arun_tool_calls,
    calculate,
    get_tool,
    python_tool,
    register_tool,
    registered_tools,
    run_tool_calls,
    tool_problems,
)

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def tool(name, fn, parameters=OBJ, timeout_s=10.0):
    return Tool(name, f"the {name} test tool", parameters, fn, timeout_s)


def call(name, **arguments):
    return ToolCall(name, arguments, raw=f"<{name}>")


# --- calculator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),  # floor division rounds toward minus infinity
        ("-7 % 3", "2"),  # Python's modulo takes the divisor's sign
        ("2 ** 10", "1024"),
        ("-(3 - 5) ** 2", "-4"),  # ** binds tighter than unary minus
        ("2 ** -2", "0.25"),
        ("1 / 4", "0.25"),
        ("6 / 3", "2"),  # a whole float reads as a whole number
        ("0.1 + 0.2", "0.3"),  # 12 significant digits hide the binary rounding
        ("1.5e3 + 2", "1502"),
        ("123456789 * 987654321", "121932631112635269"),
        ("-" * 100 + "1", "1"),  # 100 levels deep is the most it takes
    ],
)
def test_calculator_values(expression, expected):
    (result,) = run_tool_calls([call("calculator", expression=expression)], TOOLS)
    assert (result.content, result.error, result.reason) == (expected, False, None)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('touch /tmp/polyrl-calculator-pwned')", "Call is not allowed"),
        ("().__class__.__bases__[0].__subclasses__()", "is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'ab' * 3", "str constant is not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 << 3", "BinOp is not allowed"),
        ("True + 1", "bool constant is not allowed"),
        ("2 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "result too large"),  # would take minutes and gigabytes
        ("10.0 ** 400", "result too large"),
        ("1e308 * 10", "result too large"),  # inf, not a number to report
        ("(-8) ** 0.5", "complex number"),
        ("-" * 101 + "1", "nested too deeply"),  # our bound, whatever the recursion limit
        ("-" * 999 + "1", "nested too deeply"),
    ],
)
def test_calculator_refuses(expression, message):
    (result,) = run_tool_calls([call("calculator", expression=expression)], TOOLS)
    assert result.error and result.reason == "exception"
    assert result.content.startswith("error: calculator: ") and message in result.content


def test_calculator_never_runs_code(tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(ValueError, match="Call is not allowed"):
        calculate(f"__import__('os').system('touch {target}')")
    assert not target.exists()


# --- python tool -----------------------------------------------------------------------


def test_python_tool_returns_what_the_program_prints():
    results = run_tool_calls(
        [
            call("python", code="print(sum(range(101)))"),
            call("python", code="x = 1"),
            call("python", code="print('partial')\n1 / 0"),
        ],
        TOOLS,
    )
    assert [(r.content, r.error) for r in results[:2]] == [
        ("5050\n", False),
        ("(no output; print() what you want to see)", False),
    ]
    failed = results[2]
    assert failed.error and failed.reason == "exception"
    assert failed.content.startswith("error: the program exited with status 1\nstdout:\npartial")
    assert "ZeroDivisionError: division by zero" in failed.content


def test_python_tool_names_the_limit_that_stopped_the_program():
    # Two tools: a short wall clock, and a long one (60 s, never reached: the output cap
    # stops the program) so that a loaded machine cannot turn the second into a timeout.
    short = python_tool(SandboxLimits(wall_s=0.5), name="python_short")
    chatty = python_tool(SandboxLimits(wall_s=60, max_output_bytes=64), name="python_chatty")
    assert tool_problems([short, chatty]) == [] and short.timeout_s == 5.5
    results = run_tool_calls(
        [
            call("python_short", code="import time\ntime.sleep(30)"),
            call("python_chatty", code="print('y' * 100)"),
        ],
        {"python_short": short, "python_chatty": chatty},
    )
    assert [(r.reason, r.content) for r in results] == [
        ("exception", "error: the program was stopped at its time limit of 0.5 s"),
        (
            "exception",
            "error: the program was stopped: its output passed 64 bytes\nstdout:\n" + "y" * 64,
        ),
    ]


def test_python_tool_refuses_limits_that_cannot_work():
    with pytest.raises(ValueError, match=r"python_tool\('python'\): SandboxLimits.wall_s=0"):
        python_tool(SandboxLimits(wall_s=0))


# --- run_tool_calls ---------------------------------------------------------------------


@pytest.fixture(params=["threads", "asyncio"])
def runner(request):
    """run_tool_calls, and arun_tool_calls in an event loop: the same behaviour."""
    if request.param == "threads":
        return run_tool_calls
    return lambda *args, **kwargs: asyncio.run(arun_tool_calls(*args, **kwargs))


def test_hanging_tool_is_cut_at_its_timeout_and_the_other_calls_return(runner):
    release = threading.Event()
    tools = {
        "hang": tool("hang", lambda x: str(release.wait(30)), timeout_s=0.2),
        "double": tool("double", lambda x: str(2 * x)),
    }
    try:
        # One slot: the calls after the hung one run only if the timeout gives it back.
        results = runner(
            [call("hang", x=1), call("double", x=2), call("double", x=3)], tools, max_concurrency=1
        )
    finally:
        release.set()
    hung = results[0]
    assert (hung.error, hung.reason) == (True, "timeout")
    assert hung.content == "error: tool 'hang' timed out after 0.2 s"
    assert hung.seconds >= 0.2  # timed from before its thread started: at least the timeout
    assert [(r.content, r.error) for r in results[1:]] == [("4", False), ("6", False)]


def test_without_timeouts_a_slow_call_is_waited_for(runner):
    # As when debugging: a tool stopped at a breakpoint must not be cut.
    slow = tool("slow", lambda x: time.sleep(0.3) or "done", timeout_s=0.05)
    (cut,) = runner([call("slow", x=1)], {"slow": slow})
    (waited,) = runner([call("slow", x=1)], {"slow": slow}, timeouts=False)
    assert (cut.reason, waited.reason, waited.content) == ("timeout", None, "done")


def test_concurrency_is_bounded_and_used(runner):
    """Four calls, two slots: each call waits at a two-party barrier, so pairs must run
    together (one slot would break the barrier) and no third call may be inside (peak)."""
    lock, active, peak = threading.Lock(), [0], [0]
    barrier = threading.Barrier(2, timeout=10)

    def meet(x):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        barrier.wait()
        with lock:
            active[0] -= 1
        return str(x)

    results = runner(
        [call("meet", x=i) for i in range(4)], {"meet": tool("meet", meet)}, max_concurrency=2
    )
    assert [(r.content, r.error) for r in results] == [(str(i), False) for i in range(4)]
    assert peak[0] == 2


def test_one_slot_runs_calls_one_after_another(runner):
    order = []

    def record(x):
        order.append(("start", x))
        time.sleep(0.01)
        order.append(("end", x))
        return ""

    runner([call("r", x=i) for i in range(3)], {"r": tool("r", record)}, max_concurrency=1)
    assert order == [(e, i) for i in range(3) for e in ("start", "end")]


def test_exceptions_become_error_results(runner):
    def boom(x):
        raise RuntimeError(f"no luck with {x}")

    def refuse(x):
        raise ToolError(f"x={x} is out of range; give 0-9")

    tools = {
        "boom": tool("boom", boom),
        "refuse": tool("refuse", refuse),
        "number": tool("number", lambda x: x),
    }
    results = runner([call("boom", x=1), call("refuse", x=12), call("number", x=5)], tools)
    assert [(r.reason, r.error, r.content) for r in results] == [
        ("exception", True, "error: tool 'boom' failed: RuntimeError: no luck with 1"),
        ("exception", True, "error: x=12 is out of range; give 0-9"),
        ("exception", True, "error: tool 'number' returned a int, not text"),
    ]


def test_unknown_tool_and_bad_arguments_become_error_results(runner):
    tools = {"double": tool("double", lambda x: str(2 * x))}
    results = runner(
        [
            call("doubel", x=1),
            call("double"),
            call("double", x="two"),
            call("double", x=1, y=2),
            ToolCall("double", [1], raw=""),
        ],
        tools,
    )
    assert [r.reason for r in results] == ["unknown_tool"] + ["bad_arguments"] * 4
    assert all(r.error for r in results)
    assert (
        results[0].content
        == "error: unknown tool 'doubel'. Did you mean 'double'? Known: ['double']."
    )
    assert (
        results[1].content == "error: bad arguments for tool 'double': 'x' is a required property"
    )
    assert (
        results[2].content
        == "error: bad arguments for tool 'double': x: 'two' is not of type 'integer'"
    )
    # The schema allows extra properties, the function does not take them.
    assert "unexpected keyword argument 'y'" in results[3].content
    assert "arguments are a list, not a JSON object" in results[4].content


def test_nested_argument_errors_are_all_named(runner):
    schema = {
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": {"type": "integer"}},
            "label": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }
    nested = tool("nested", lambda points=(), label=None: "ok", parameters=schema)
    (result,) = runner([call("nested", points=[1, "b"], label={"text": 3})], {"nested": nested})
    assert result.reason == "bad_arguments"
    assert result.content == (
        "error: bad arguments for tool 'nested': label/text: 3 is not of type 'string'; "
        "points/1: 'b' is not of type 'integer'"
    )


def test_a_schema_that_cannot_be_checked_is_an_error_result(runner):
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}
    broken = tool("broken", lambda x=0: "ok", parameters=schema)
    (result,) = runner([call("broken", x=1)], {"broken": broken})
    assert result.reason == "exception" and result.content.startswith(
        "error: tool 'broken' could not check its arguments: "
    )


def test_calls_past_the_limit_are_not_run(runner):
    ran = []
    tools = {"r": tool("r", lambda x: ran.append(x) or "ok")}
    results = runner([call("r", x=i) for i in range(4)], tools, max_calls=2)
    assert sorted(ran) == [0, 1]
    assert [r.reason for r in results] == [None, None, "limit", "limit"]
    assert results[2].content == "error: tool call limit reached (2 calls); this call was not run"


def test_result_message_is_a_tool_chat_message():
    (result,) = run_tool_calls([call("calculator", expression="1+1")], TOOLS)
    assert result.message() == {"role": "tool", "name": "calculator", "content": "2"}


def test_event_loop_runs_other_episodes_while_calls_run():
    """Three episodes' calls in one event loop, one slot each: they meet at a three-party
    barrier, which only works if no episode's calls block the loop."""
    barrier = threading.Barrier(3, timeout=10)
    meet = tool("meet", lambda x: str(barrier.wait() >= 0 and x))

    async def episodes():
        return await asyncio.gather(
            *(
                arun_tool_calls([call("meet", x=i)], {"meet": meet}, max_concurrency=1)
                for i in range(3)
            )
        )

    results = asyncio.run(episodes())
    assert [(r.content, r.error) for (r,) in results] == [("0", False), ("1", False), ("2", False)]


# --- registry and validation -----------------------------------------------------------


def test_builtins_are_registered_and_valid():
    assert {"calculator", "python"} <= set(registered_tools())
    assert tool_problems([get_tool("calculator"), get_tool("python")]) == []


def test_unknown_tool_name_names_the_close_match():
    with pytest.raises(
        ValueError, match=r"unknown tool 'calculater'\. Did you mean 'calculator'\?"
    ):
        get_tool("calculater")


def test_register_refuses_a_second_tool_under_a_name_and_a_broken_tool():
    mine = tool("test-double", lambda x: str(2 * x))
    try:
        assert register_tool(mine) is mine and register_tool(mine) is mine
        with pytest.raises(ValueError, match="'test-double' is already registered"):
            register_tool(tool("test-double", lambda x: ""))
        with pytest.raises(ValueError, match="timeout_s=-1"):
            register_tool(tool("test-broken", lambda x: "", timeout_s=-1))
    finally:
        TOOLS.pop("test-double", None)
    assert "test-broken" not in TOOLS


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (tool("has space", lambda x: ""), "tool 'has space': name must be 1-64 letters"),
        (Tool("t", " ", OBJ, lambda x: ""), "tool 't': description is empty"),
        (
            tool("t", lambda x: "", parameters={"type": "string"}),
            "tool 't': parameters has type 'string'",
        ),
        (tool("t", lambda x: "", parameters=[]), "tool 't': parameters is a list"),
        (
            tool(
                "t",
                lambda x: "",
                parameters={"type": "object", "properties": {"x": {"type": "int"}}},
            ),
            "tool 't': parameters is not a valid JSON schema at properties/x/type",
        ),
        (
            tool(
                "t",
                lambda x: "",
                parameters={"type": "object", "properties": {}, "required": ["x"]},
            ),
            "tool 't': parameters.required names ['x'], which are not in parameters.properties",
        ),
        (
            tool("t", lambda y=0: ""),
            f"tool 't': fn {__name__}.<lambda> takes no keyword argument ['x']",
        ),
        (
            tool("t", lambda x, y: ""),
            f"tool 't': fn {__name__}.<lambda> needs ['y'], which parameters.required does not list",
        ),
        (tool("t", "not a function"), "tool 't': fn is a str, not callable"),
        (tool("t", lambda x: "", timeout_s=0), "tool 't': timeout_s=0; give a positive number"),
        (tool("t", lambda x: "", timeout_s=float("inf")), "tool 't': timeout_s=inf"),
        ("calculator", "tools[0] is a str, not a polyrl.envs.tools.Tool"),
    ],
)
def test_tool_problems_name_the_tool_the_field_and_the_fix(bad, message):
    problems = tool_problems([bad])
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_tool_problems_finds_duplicate_names():
    calc = get_tool("calculator")
    assert tool_problems([calc, calc]) == [
        "tool 'calculator': name offered twice; each tool offered together needs its own name"
    ]


def test_keyword_catch_all_accepts_any_properties():
    assert tool_problems([tool("t", lambda **kw: "")]) == []


# --- schemas in a real chat template ----------------------------------------------------

# A shortened Qwen2.5 chat template: the tools block of its system prompt, assistant
# tool_calls written as <tool_call> JSON, tool results as <tool_response> in a user turn.
QWEN25_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_schemas_render_in_a_qwen_chat_template(tokenizer):
    tools = [get_tool("calculator"), get_tool("python")]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        tools=[t.schema() for t in tools],
        chat_template=QWEN25_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in block.splitlines()] == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": get_tool("calculator").description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "for example (3 + 4) * 12 / 7",
                        }
                    },
                    "required": ["expression"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "python",
                "description": get_tool("python").description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "the complete program"}
                    },
                    "required": ["code"],
                },
            },
        },
    ]
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_template_written_calls_parse_back_and_results_render_as_tool_responses(tokenizer):
    """What the template writes for an assistant's tool calls is what the hermes parser
    reads, and a result's message() renders as the template's tool response."""
    arguments = [{"expression": "(2 + 3) * 4"}, {"code": 'print("a\\"b")'}]
    messages = [
        {"role": "user", "content": "Compute."},
        {
            "role": "assistant",
            "content": "I will use tools.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": arguments[0]}},
                {"type": "function", "function": {"name": "python", "arguments": arguments[1]}},
            ],
        },
    ]
    text = tokenizer.apply_chat_template(messages, chat_template=QWEN25_TEMPLATE, tokenize=False)
    turn = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(turn)
    assert parsed.errors == [] and parsed.text == "I will use tools."
    assert [(c.name, dict(c.arguments)) for c in parsed.calls] == list(
        zip(["calculator", "python"], arguments, strict=True)
    )

    results = run_tool_calls(parsed.calls, TOOLS)
    assert [r.content for r in results] == ["20", 'a"b\n']
    rendered = tokenizer.apply_chat_template(
        [*messages, *(r.message() for r in results)],
        chat_template=QWEN25_TEMPLATE,
        tokenize=False,
    )
    assert rendered.endswith(
        '<|im_start|>user\n<tool_response>\n20\n</tool_response>\n<tool_response>\na"b\n\n'
        "</tool_response><|im_end|>\n"
    )
