"""Tool calls parsed out of one model turn, for a tool-using agent loop.

The loop picks a parser by name and calls `parse_tool_calls` after each turn. Whatever
cannot be run becomes an error text for the model's next turn, never an exception:

- "hermes" (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the turn; the text outside them is the content.
- "llama3_json" (Llama 3.x): the turn, optionally after `<|python_tag|>`, is a JSON object
  `{"name": ..., "parameters": {...}}`, or several separated by `;`. Text that is not such
  JSON is plain content.
- "none": no tool calls; the whole turn is content.

Calls are numbered from 1 in the order the model wrote them; errors name that number.
Only the first MAX_CALLS_PER_TURN calls are examined; the rest are one error.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator

from rlmesh.common import safe_json

MAX_CALLS_PER_TURN = 16
MAX_NAME_CHARS = 128
MAX_ARGUMENTS_BYTES = 64 * 1024
_QUOTED_CHARS = 60  # how much of a bad value an error message repeats back to the model
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    """One call to run: `id` is the model's own id if it gave a usable one, else call_<k>
    (k counts this turn's calls from 0)."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """What a model turn asked for. `errors` are meant for the model, as text; `truncated`
    says a call was cut off by the token limit (finish_reason "length") and not run."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    truncated: bool = False


ToolParser = Callable[[str, str | None], ParsedTurn]  # (text, finish_reason) -> ParsedTurn
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Decorator: make `parser(text, finish_reason) -> ParsedTurn` available under `name`."""

    def register(parser: ToolParser) -> ToolParser:
        if name in _PARSERS:
            raise ValueError(f"a tool parser named {name!r} is already registered")
        _PARSERS[name] = parser
        return parser

    return register


def tool_parser_names() -> list[str]:
    """The names `parse_tool_calls` accepts, sorted."""
    return sorted(_PARSERS)


def _registered_parser(name: str) -> str:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_parser_names())}")
    return name


# A setting or option that names a parser: checked against the registered ones.
ToolParserName = Annotated[str, AfterValidator(_registered_parser)]


def parse_tool_calls(parser_name: str, text: str, finish_reason: str | None = None) -> ParsedTurn:
    """The content, tool calls and errors of one model turn, read by the named parser.
    `finish_reason` is the engine's ("stop", "length", ...); "length" marks an unfinished
    call as cut off rather than malformed. Raises ValueError only for an unknown parser."""
    parser = _PARSERS.get(parser_name)
    if parser is None:
        raise ValueError(f"unknown tool parser {parser_name!r}; known parsers: {', '.join(tool_parser_names())}")
    return parser(text, finish_reason)


def render_tool_calls_for_template(calls: list[ToolCall], *, arguments_as_dict: bool = False) -> list[dict]:
    """The `tool_calls` of an assistant message, OpenAI style:
    {"id", "type": "function", "function": {"name", "arguments": <JSON text>}}.

    Chat templates that pipe the arguments through `tojson` (Qwen2.5, Llama 3.1/3.2) need
    them as a dict, or they render the JSON text as one quoted string: pass
    arguments_as_dict=True for those. Qwen3's template takes either."""
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": copy.deepcopy(call.arguments)
                if arguments_as_dict
                else json.dumps(call.arguments, ensure_ascii=False),
            },
        }
        for call in calls
    ]


def _quote(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "…"


def _json_error(error: json.JSONDecodeError, start: int = 0) -> str:
    return f"{error.msg} at char {error.pos - start}"


def _decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value at `pos` and where it ends; nesting too deep for the decoder is a
    JSONDecodeError like any other bad JSON, not a crash of the loop."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, pos) from None


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


class _TurnCalls:
    """The calls of one turn as they are found: numbers them, bounds them, and turns each
    into a ToolCall or an error."""

    def __init__(self, argument_keys: tuple[str, str]) -> None:
        self.argument_keys = argument_keys  # the format's own key first, the other accepted too
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.truncated = False
        self.count = 0
        self._ids: set[str] = set()

    def next_number(self) -> int | None:
        """The number of the call found next, or None (and an error) past the bound."""
        self.count += 1
        if self.count > MAX_CALLS_PER_TURN:
            self.errors.append(
                f"tool call {self.count} and any after it were not run: "
                f"at most {MAX_CALLS_PER_TURN} tool calls per turn"
            )
            return None
        return self.count

    def cut_off(self, number: int) -> None:
        self.truncated = True
        self.errors.append(f"tool call {number} was cut off by the token limit and was not run")

    def add_json(self, number: int, raw: str) -> None:
        try:
            obj = safe_json.loads(raw)
        except json.JSONDecodeError as e:
            self.errors.append(f"tool call {number} is not valid JSON: {_json_error(e)}")
            return
        self.add_object(number, obj)

    def add_object(self, number: int, obj: Any) -> None:
        call = self._call(number, obj)
        if isinstance(call, str):
            self.errors.append(call)
        else:
            self.calls.append(call)
            self._ids.add(call.id)

    def _call(self, number: int, obj: Any) -> ToolCall | str:
        """A ToolCall from a decoded call object, or what is wrong with it."""
        own_key = self.argument_keys[0]
        if not isinstance(obj, dict):
            return (
                f'tool call {number} must be a JSON object {{"name": ..., "{own_key}": {{...}}}}, '
                f"not {type(obj).__name__}"
            )
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return f'tool call {number} has no "name" (the tool to call, as a string)'
        if len(name) > MAX_NAME_CHARS:
            return f"tool call {number}: its name is {len(name)} characters long; at most {MAX_NAME_CHARS}"
        if not _NAME.fullmatch(name):
            return f'tool call {number}: name {_quote(name)} may only use letters, digits, "_", "." and "-"'
        key = next((k for k in self.argument_keys if k in obj), own_key)
        arguments = obj.get(key)
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            if len(arguments.encode()) > MAX_ARGUMENTS_BYTES:
                return self._too_long(number, name)
            try:
                arguments = safe_json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return f'tool call {number} ({name}): "{key}" is a string that is not valid JSON: {_json_error(e)}'
        if not isinstance(arguments, dict):
            return f'tool call {number} ({name}): "{key}" must be a JSON object, not {type(arguments).__name__}'
        try:
            size = len(json.dumps(arguments, ensure_ascii=False).encode())
        except RecursionError:
            return f"tool call {number} ({name}): its arguments are nested too deeply"
        if size > MAX_ARGUMENTS_BYTES:
            return self._too_long(number, name)
        return ToolCall(self._id(obj.get("id")), name, arguments)

    @staticmethod
    def _too_long(number: int, name: str) -> str:
        return f"tool call {number} ({name}): its arguments are longer than {MAX_ARGUMENTS_BYTES} bytes of JSON"

    def _id(self, given: Any) -> str:
        # The model's id is kept only when it is short, plain and unique in the turn.
        if (
            isinstance(given, str)
            and len(given) <= MAX_NAME_CHARS
            and _NAME.fullmatch(given)
            and given not in self._ids
        ):
            return given
        k = len(self.calls)
        while f"call_{k}" in self._ids:
            k += 1
        return f"call_{k}"

    def turn(self, content: str) -> ParsedTurn:
        return ParsedTurn(content=content, calls=self.calls, errors=self.errors, truncated=self.truncated)


def _join_content(pieces: list[str]) -> str:
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"


@register_tool_parser("hermes")
def hermes(text: str, finish_reason: str | None) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""
    found = _TurnCalls(("arguments", "parameters"))
    outside: list[str] = []
    pos = 0
    while (start := text.find(_HERMES_OPEN, pos)) != -1:
        outside.append(text[pos:start])
        number = found.next_number()
        if number is None:  # past the bound: the rest of the turn is not read
            pos = len(text)
            break
        body_start = start + len(_HERMES_OPEN)
        body_end, next_pos = _hermes_block_end(text, body_start)
        if body_end is None:
            if next_pos == len(text) and finish_reason == "length":
                found.cut_off(number)
            else:
                found.errors.append(f"tool call {number} was not closed with {_HERMES_CLOSE} and was not run")
        else:
            found.add_json(number, text[body_start:body_end].strip())
        pos = next_pos
    outside.append(text[pos:])
    return found.turn(_join_content(outside))


def _hermes_block_end(text: str, body_start: int) -> tuple[int | None, int]:
    """Where the JSON of a block ends (its closing tag) and where reading goes on; the end is
    None when the block is not closed before the next `<tool_call>` or the end of the text."""
    search_from = body_start
    try:
        # Look for the closing tag after the JSON value, so one inside an argument string is not it.
        _, search_from = _decode(text, _skip_whitespace(text, body_start))
    except json.JSONDecodeError:
        pass
    next_open = text.find(_HERMES_OPEN, search_from)
    limit = len(text) if next_open == -1 else next_open
    close = text.find(_HERMES_CLOSE, search_from, limit)
    if close == -1:
        return None, limit
    return close, close + len(_HERMES_CLOSE)


_PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\{\s*"name"\s*:')


@register_tool_parser("llama3_json")
def llama3_json(text: str, finish_reason: str | None) -> ParsedTurn:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, `;`-separated, optionally
    after `<|python_tag|>`. Without the tag, a turn is read as calls only when it starts with
    a call object; any other text, JSON answers included, is content."""
    before, tag, body = text.partition(_PYTHON_TAG)
    if not tag:
        before, body = "", text
    pos = _skip_whitespace(body, 0)
    if not tag and not _starts_with_call(body, pos):
        return ParsedTurn(content=text.strip())
    found = _TurnCalls(("parameters", "arguments"))
    if pos == len(body):  # a bare tag: the call never came
        if finish_reason == "length":
            found.cut_off(1)
        else:
            found.errors.append(f"tool call 1 after {_PYTHON_TAG} is empty")
    while pos < len(body):
        if found.count and not body.startswith("{", pos):  # text after the calls is content
            break
        number = found.next_number()
        if number is None:
            pos = len(body)
            break
        try:
            obj, end = _decode(body, pos)
        except json.JSONDecodeError as e:
            if finish_reason == "length":
                found.cut_off(number)
            elif body.startswith("{", pos):
                found.errors.append(f"tool call {number} is not valid JSON: {_json_error(e, pos)}")
            else:
                found.errors.append(
                    f"tool call {number} after {_PYTHON_TAG} must be a JSON object "
                    f'{{"name": ..., "parameters": {{...}}}}'
                )
            pos = len(body)  # past a broken object the next one cannot be found reliably
            break
        found.add_object(number, obj)
        pos = _skip_whitespace(body, end)
        if body.startswith(";", pos):
            pos = _skip_whitespace(body, pos + 1)
    return found.turn(_join_content([before, body[pos:]]))


def _starts_with_call(body: str, pos: int) -> bool:
    """Whether untagged text starts with a call: a JSON object with a name and arguments, or,
    when it does not decode (malformed or cut off), one that opens with "name"."""
    if not body.startswith("{", pos):
        return False
    try:
        obj, _ = _decode(body, pos)
    except json.JSONDecodeError:
        return _CALL_START.match(body, pos) is not None
    return "name" in obj and ("parameters" in obj or "arguments" in obj)


@register_tool_parser("none")
def no_tool_calls(text: str, finish_reason: str | None) -> ParsedTurn:
    """No tool calls: the whole turn is content."""
    return ParsedTurn(content=text.strip())
