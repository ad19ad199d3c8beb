"""Tool-call parsers: the Hermes/Qwen format, well-formed and malformed turns, the registry."""

from __future__ import annotations

import pytest

from polyrl.envs.parsers import (
    ParseResult,
    get_parser,
    parse_tool_calls,
    register_parser,
    registered_parsers,
)
from polyrl.envs.tools import ToolCall

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


def test_one_call_and_the_text_around_it():
    result = parse_tool_calls(f"Let me compute.\n{CALL}\nDone?")
    assert result.errors == []
    assert result.calls == [ToolCall("calculator", {"expression": "2 + 3"}, CALL)]
    assert result.text == "Let me compute.\n\nDone?"


def test_several_calls_in_order():
    second = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    third = (
        '<tool_call>{"name": "lookup", "arguments": {"n": 3, "deep": [1, {"a": null}]}}</tool_call>'
    )
    result = parse_tool_calls(f"{CALL}{second}\n{third}")
    assert [(c.name, dict(c.arguments), c.raw) for c in result.calls] == [
        ("calculator", {"expression": "2 + 3"}, CALL),
        ("python", {"code": "print(1)"}, second),
        ("lookup", {"n": 3, "deep": [1, {"a": None}]}, third),
    ]
    assert result.errors == [] and result.text == ""


def test_no_call_is_plain_text():
    assert parse_tool_calls("  The answer is 5.  ") == ParseResult("The answer is 5.", [], [])


def test_arguments_given_as_a_json_string_or_left_out():
    # Some models write OpenAI-style string arguments; a call of a tool without
    # parameters may leave them out.
    result = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert result.errors == []
    assert [(c.name, dict(c.arguments)) for c in result.calls] == [("f", {"x": 1}), ("now", {})]


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ('<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>', "invalid JSON"),
        ("<tool_call>{'name': 'f'}</tool_call>", "invalid JSON"),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>["f", {"x": 1}]</tool_call>', "JSON array, not an object"),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            "\"arguments\" of 'f' is a JSON array",
        ),
        ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', "a string that is not JSON"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "never closed"),
        ('{"name": "f"}</tool_call>', "</tool_call> without <tool_call>"),
    ],
)
def test_malformed_call_is_an_error_not_a_call(turn, expected):
    result = parse_tool_calls(f"before {turn} after")
    assert result.calls == []
    assert len(result.errors) == 1 and expected in result.errors[0], result.errors
    assert result.errors[0].startswith("tool call 1: ")


def test_malformed_call_among_good_ones_is_numbered_and_the_rest_still_parse():
    # An unclosed tag followed by a well-formed call: the unclosed one ends where the next
    # opening tag starts, and its body is neither a call nor text.
    turn = f'Try: <tool_call>{{"name": "f", "arguments": {{"x": 1}}}}\n{CALL} and <tool_call>{{bad}}</tool_call> end'
    result = parse_tool_calls(turn)
    assert [c.name for c in result.calls] == ["calculator"]
    assert len(result.errors) == 2
    assert result.errors[0].startswith("tool call 1: <tool_call> is never closed")
    assert result.errors[1].startswith("tool call 3: invalid JSON")
    assert result.text == "Try:  and  end"


def test_malformed_calls_as_error_results():
    result = parse_tool_calls('<tool_call>{"x": 1}</tool_call><tool_call>{bad</tool_call>')
    (first, second) = result.error_results()
    assert (first.name, first.error, first.reason) == ("", True, "malformed")
    assert first.content == "error: " + result.errors[0]
    assert second.content.startswith("error: tool call 2: invalid JSON")
    assert first.message()["role"] == "tool"


def test_error_tells_the_model_the_expected_format():
    (error,) = parse_tool_calls('<tool_call>{"x": 1}</tool_call>').errors
    assert '{"name": "<tool name>", "arguments": {<arguments>}}' in error


def test_turn_cut_at_its_token_limit_quotes_the_partial_call():
    (error,) = parse_tool_calls('<tool_call>\n{"name": "python", "arguments": {"code": "pri').errors
    assert "never closed" in error and '"code": "pri' in error


def test_unknown_parser_names_the_close_match_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'hermés'.*'hermes'.*Known"):
        get_parser("hermés")


def test_register_a_parser_and_refuse_a_second_under_its_name():
    @register_parser("test-bracket")
    def bracket(text: str) -> ParseResult:
        name, _, rest = text.partition("[")
        return ParseResult("", [ToolCall(rest.rstrip("]"), {}, text)], [])

    try:
        assert "test-bracket" in registered_parsers()
        assert parse_tool_calls("x[f]", parser="test-bracket").calls[0].name == "f"
        register_parser("test-bracket")(bracket)  # the same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_parser("test-bracket")(lambda text: ParseResult(text, [], []))
    finally:
        from polyrl.envs.parsers import PARSERS

        PARSERS.pop("test-bracket", None)


# --- llama3_json -----------------------------------------------------------------------


def test_llama3_json_call_with_or_without_the_python_tag():
    call = '{"name": "calculator", "parameters": {"expression": "2 + 3"}}'
    for turn in (call, f"<|python_tag|>{call}", f"  {call}\n"):
        result = parse_tool_calls(turn, parser="llama3_json")
        assert result == ParseResult(
            "", [ToolCall("calculator", {"expression": "2 + 3"}, call)], []
        )


def test_llama3_json_several_calls_and_arguments_key():
    first = '{"name": "f", "parameters": {"x": 1}}'
    second = '{"name": "g", "arguments": {"y": [2, 3]}}'
    result = parse_tool_calls(f"{first}; {second}\nThanks.", parser="llama3_json")
    assert [(c.name, dict(c.arguments), c.raw) for c in result.calls] == [
        ("f", {"x": 1}, first),
        ("g", {"y": [2, 3]}, second),
    ]
    assert (result.text, result.errors) == ("Thanks.", [])


def test_llama3_json_answer_is_not_a_call():
    turn = 'The answer is {"x": 1}, computed by hand.'
    assert parse_tool_calls(turn, parser="llama3_json") == ParseResult(turn, [], [])


@pytest.mark.parametrize(
    ("turn", "number", "expected"),
    [
        ('{"name": "f", "parameters": {"x": 1}', 1, "invalid JSON"),
        ('{"parameters": {"x": 1}}', 1, 'the call has no "name"'),
        ('{"name": "f", "parameters": [1]}', 1, "\"parameters\" of 'f' is a JSON array"),
        ('{"name": "f", "parameters": {}}; {"name": ', 2, "invalid JSON"),
    ],
)
def test_llama3_json_malformed(turn, number, expected):
    result = parse_tool_calls(turn, parser="llama3_json")
    (error,) = result.errors
    assert error.startswith(f"tool call {number}: ") and expected in error, error
    assert '{"name": "<tool name>", "parameters": {<arguments>}}' in error
    assert [c.name for c in result.calls] == ["f"] * (number - 1)
