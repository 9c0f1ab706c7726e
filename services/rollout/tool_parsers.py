"""Tool calls parsed out of a model turn, for a tool-using agent loop. A parser is
chosen per run by name; what it cannot use becomes an error text for the model's next
turn, never an exception:

- "hermes" (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the turn; the text outside them is the content.
- "llama3_json" (Llama 3.x): the whole turn, optionally after `<|python_tag|>`, is one JSON
  object `{"name": ..., "parameters": {...}}` or several separated by `;`; anything else is
  plain content.
- "none": no tool calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_CALLS_PER_TURN = 16
MAX_NAME_CHARS = 128
MAX_ARGUMENTS_BYTES = 64 * 1024
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # returned to the model as text
    truncated: bool = False  # a call cut off by the token limit (not executed)


ToolParser = Callable[[str, str], ParsedTurn]  # (text, finish_reason) -> ParsedTurn
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    def register(parser: ToolParser) -> ToolParser:
        _PARSERS[name] = parser
        return parser
    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def parse_tool_calls(parser_name: str, text: str, finish_reason: str = "stop") -> ParsedTurn:
    try:
        parser = _PARSERS[parser_name]
    except KeyError:
        raise ValueError(f"unknown tool parser {parser_name!r}; known: {', '.join(tool_parser_names())}") from None
    return parser(text, finish_reason)


def render_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI-style `tool_calls` of an assistant message (what chat templates render)."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]


def _call_from_json(raw: str, number: int, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from one call's JSON text, or what is wrong with it (for the model)."""
    if len(raw.encode()) > MAX_ARGUMENTS_BYTES:
        return f"tool call {number} is longer than {MAX_ARGUMENTS_BYTES} bytes"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"tool call {number} is not valid JSON: {e}"
    if not isinstance(obj, dict):
        return f"tool call {number} must be a JSON object with \"name\" and \"{argument_keys[0]}\""
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME_CHARS:
        return (f"tool call {number} needs a \"name\": letters, digits, '_', '.', '-', at most "
                f"{MAX_NAME_CHARS} characters")
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models send the arguments as JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool call {number} ({name}): its arguments are not valid JSON: {e}"
    if not isinstance(arguments, dict):
        return f"tool call {number} ({name}): \"{argument_keys[0]}\" must be a JSON object"
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else f"call_{number - 1}"
    return ToolCall(call_id, name, arguments)


def _collect(raws: list[str], argument_keys: tuple[str, ...], turn: ParsedTurn) -> ParsedTurn:
    for number, raw in enumerate(raws, 1):
        if number > MAX_CALLS_PER_TURN:
            turn.errors.append(f"tool call {number}: at most {MAX_CALLS_PER_TURN} calls per turn; "
                               f"{len(raws) - MAX_CALLS_PER_TURN} were not run")
            break
        call = _call_from_json(raw, number, argument_keys)
        (turn.calls if isinstance(call, ToolCall) else turn.errors).append(call)
    return turn


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


@register_tool_parser("hermes")
def hermes(text: str, finish_reason: str) -> ParsedTurn:
    raws = [m.strip() for m in _HERMES_BLOCK.findall(text)]
    content = _HERMES_BLOCK.sub("", text)
    turn = ParsedTurn(content="")
    opened = content.find(_HERMES_OPEN)
    if opened >= 0:  # an opening tag never closed: cut by the token limit, or malformed
        turn.truncated = finish_reason == "length"
        turn.errors.append("a tool call was cut off by the token limit and was not run" if turn.truncated
                           else "a <tool_call> was not closed with </tool_call> and was not run")
        content = content[:opened]
    turn.content = content.strip()
    errors = turn.errors
    turn.errors = []
    _collect(raws, ("arguments", "parameters"), turn)
    turn.errors += errors
    return turn


_PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
def llama3_json(text: str, finish_reason: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    objects = _json_objects(body)
    if objects is not None:
        return _collect(objects, ("parameters", "arguments"), ParsedTurn(content=""))
    if finish_reason == "length":
        return ParsedTurn(content="", errors=["a tool call was cut off by the token limit and was not run"],
                          truncated=True)
    if tagged:  # meant as a call: say what is wrong with it
        return _collect([body], ("parameters", "arguments"), ParsedTurn(content=""))
    return ParsedTurn(content=text.strip())  # prose that happens to start with "{"


def _json_objects(body: str) -> list[str] | None:
    """The JSON object texts of a turn: the whole body, or its ';'-separated parts; None
    when it is neither."""
    for parts in ([body], [p.strip() for p in body.split(";") if p.strip()]):
        try:
            if all(isinstance(json.loads(p), dict) for p in parts):
                return parts
        except json.JSONDecodeError:
            continue
    return None


@register_tool_parser("none")
def no_tools(text: str, finish_reason: str) -> ParsedTurn:
    return ParsedTurn(content=text.strip())
