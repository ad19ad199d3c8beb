"""Tool calls parsed out of a model turn, one parser per chat-template format.

A parser takes the text of one assistant turn and returns a :class:`ParseResult`: the
text outside the calls, the well-formed calls (``polyrl.envs.tools.ToolCall``) and one
error message per malformed call, written for the model to read (the episode loop
returns it as an error observation). Parsers are registered by name
(:func:`register_parser`); the template a model was trained with decides which one fits.

``hermes`` -- Hermes 2 Pro / Qwen2.5 / Qwen3: each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; a
turn may hold several.

``llama3_json`` -- Llama 3.1-3.3: the turn is ``{"name": ..., "parameters": {...}}``
(several separated by ``;``), optionally after ``<|python_tag|>``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from polyrl.envs.tools import ToolCall, ToolResult, unknown_name

__all__ = [
    "ParseResult",
    "PARSERS",
    "register_parser",
    "get_parser",
    "registered_parsers",
    "parse_tool_calls",
]


@dataclasses.dataclass(frozen=True)
class ParseResult:
    """``text``: the turn without its calls (stripped); ``calls``: the well-formed calls in
    order; ``errors``: one message per malformed call (bad JSON, no name, unclosed tag...)."""

    text: str
    calls: list[ToolCall]
    errors: list[str]

    def error_results(self) -> list[ToolResult]:
        """Each malformed call as an error result (reason "malformed"), to return to the
        model as a ``tool`` message and count with the calls' own errors."""
        return [ToolResult("", "error: " + e, True, 0.0, "malformed") for e in self.errors]


Parser = Callable[[str], ParseResult]
PARSERS: dict[str, Parser] = {}


def register_parser(name: str) -> Callable[[Parser], Parser]:
    """Decorator: parse tool calls of the format ``name`` with the function
    ``(turn text) -> ParseResult``."""

    def deco(fn: Parser) -> Parser:
        if name in PARSERS and PARSERS[name] is not fn:
            raise ValueError(
                f"a tool-call parser named {name!r} is already registered "
                f"({PARSERS[name].__module__}.{PARSERS[name].__qualname__}); give yours another name"
            )
        PARSERS[name] = fn
        return fn

    return deco


def get_parser(name: str) -> Parser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            unknown_name("tool-call parser", name, PARSERS)
            + " Register one with @polyrl.envs.parsers.register_parser(name)."
        ) from None


def registered_parsers() -> list[str]:
    return sorted(PARSERS)


def parse_tool_calls(text: str, parser: str = "hermes") -> ParseResult:
    """The tool calls in one assistant turn, parsed by the registered ``parser``."""
    return get_parser(parser)(text)


# --- hermes ----------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>'
_SNIPPET = 200  # characters of a malformed call quoted back to the model


@register_parser("hermes")
def hermes(text: str) -> ParseResult:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.
    An opening tag with no closing one before the next opening tag (or the end: a turn
    cut at its token limit) is a malformed call, as is a closing tag with no opening one;
    neither part goes into ``text``."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while pos < len(text):
        start, stray = text.find(OPEN, pos), text.find(CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            outside.append(text[pos:stray])
            errors.append(f"tool call {len(calls) + len(errors) + 1}: {CLOSE} without {OPEN}")
            pos = stray + len(CLOSE)
            continue
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body = start + len(OPEN)
        end, following = text.find(CLOSE, body), text.find(OPEN, body)
        number = len(calls) + len(errors) + 1
        if end == -1 or following != -1 and following < end:
            errors.append(
                f"tool call {number}: {OPEN} is never closed by {CLOSE}: "
                f"{_snippet(text[body : following if following != -1 else len(text)])}"
            )
            pos = following if following != -1 else len(text)
            continue
        raw = text[start : end + len(CLOSE)]
        call = _hermes_call(text[body:end], raw)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {call}. Write each call as {HERMES_FORMAT}")
        pos = end + len(CLOSE)
    return ParseResult("".join(outside).strip(), calls, errors)


def _hermes_call(body: str, raw: str) -> ToolCall | str:
    """The call in one tag's body, or what is wrong with it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno}) in {_snippet(body)}"
    return _call_from_json(obj, raw, "arguments")


def _call_from_json(obj: Any, raw: str, key: str) -> ToolCall | str:
    """``{"name": ..., key: {...}}`` as a call, or what is wrong with it. The arguments may
    be left out (a tool without parameters) or be a JSON string holding the object (as
    OpenAI's API writes them, which some models copy)."""
    if not isinstance(obj, dict):
        return f"the call is a JSON {_json_type(obj)}, not an object"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'the call has no "name" (a non-empty string)'
    arguments = obj.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'"{key}" of {name!r} is a string that is not JSON: {_snippet(arguments)}'
    if not isinstance(arguments, dict):
        return f'"{key}" of {name!r} is a JSON {_json_type(arguments)}, not an object'
    return ToolCall(name=name.strip(), arguments=arguments, raw=raw)


# --- llama3_json -----------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
LLAMA3_FORMAT = '{"name": "<tool name>", "parameters": {<arguments>}}'
_DECODER = json.JSONDecoder()


@register_parser("llama3_json")
def llama3_json(text: str) -> ParseResult:
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the turn *is* the call(s) --
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``, optionally after
    ``<|python_tag|>`` (a special token: only there if the turn was decoded with special
    tokens). A turn that does not start with ``{`` is an answer, not a call. Text after
    the last call is kept as ``text``; JSON that does not parse ends the calls there."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParseResult(text.strip(), [], [])
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while pos < len(body) and body[pos] == "{":
        number = len(calls) + len(errors) + 1
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(
                f"tool call {number}: invalid JSON ({e.msg} at column {e.pos - pos + 1}) in "
                f"{_snippet(body[pos:])}. Write each call as {LLAMA3_FORMAT}"
            )
            return ParseResult("", calls, errors)
        call = _call_from_json(
            obj, body[pos:end], "parameters" if "parameters" in obj else "arguments"
        )
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {call}. Write each call as {LLAMA3_FORMAT}")
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return ParseResult(body[pos:].strip(), calls, errors)


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SNIPPET else text[:_SNIPPET] + "...")
