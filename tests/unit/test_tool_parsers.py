"""Tool-call parsers against model outputs in the formats real models write."""

from __future__ import annotations

import json

import pytest

from rlmesh.rollout.tool_parsers import (
    MAX_CALLS_PER_TURN,
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
    tool_parser_names,
)

HERMES = [
    # (text, finish_reason, content, calls [(name, arguments)], number of errors, truncated)
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "stop",
     "", [("add", {"a": 1, "b": 2})], 0, False),
    ('I will look both up.\n<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>\n'
     '<tool_call>{"name": "search", "arguments": {"q": "y"}}</tool_call>', "stop",
     "I will look both up.", [("search", {"q": "x"}), ("search", {"q": "y"})], 0, False),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done', "stop",
     "done", [("add", {"a": 1})], 0, False),  # arguments as JSON text
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "stop", "", [], 1, False),  # bad JSON
    ('<tool_call>{"arguments": {}}</tool_call>', "stop", "", [], 1, False),  # no name
    ('<tool_call>{"name": "rm -rf", "arguments": {}}</tool_call>', "stop", "", [], 1, False),  # bad name
    ('Let me add.<tool_call>{"name": "add", "argum', "length", "Let me add.", [], 1, True),  # cut by the limit
    ('<tool_call>{"name": "add", "arguments": {}}', "stop", "", [], 1, False),  # never closed
    ("The answer is 4.", "stop", "The answer is 4.", [], 0, False),
]


@pytest.mark.parametrize(("text", "finish", "content", "calls", "errors", "truncated"), HERMES)
def test_hermes(text, finish, content, calls, errors, truncated):
    turn = parse_tool_calls("hermes", text, finish)
    assert turn.content == content
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == errors and turn.truncated == truncated
    assert [c.id for c in turn.calls] == [f"call_{i}" for i in range(len(calls))]


LLAMA = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "stop",
     "", [("get_weather", {"city": "Paris"})], 0, False),
    ('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', "stop",
     "", [("a", {}), ("b", {"x": 1})], 0, False),
    ('{"name": "echo", "parameters": {"text": "a;b"}}', "stop", "", [("echo", {"text": "a;b"})], 0, False),
    ('<|python_tag|>{"name": "a", "parameters": {', "length", "", [], 1, True),
    ('<|python_tag|>{"name": "a", "parameters": {]}', "stop", "", [], 1, False),
    ("Paris is sunny today.", "stop", "Paris is sunny today.", [], 0, False),
    ("{not json, just braces}", "stop", "{not json, just braces}", [], 0, False),
]


@pytest.mark.parametrize(("text", "finish", "content", "calls", "errors", "truncated"), LLAMA)
def test_llama3_json(text, finish, content, calls, errors, truncated):
    turn = parse_tool_calls("llama3_json", text, finish)
    assert turn.content == content
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == errors and turn.truncated == truncated


def test_calls_per_turn_are_bounded_and_the_rest_reported():
    text = "".join(f'<tool_call>{{"name": "f", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(20))
    turn = parse_tool_calls("hermes", text)
    assert len(turn.calls) == MAX_CALLS_PER_TURN
    assert turn.errors == [f"tool call 17: at most {MAX_CALLS_PER_TURN} calls per turn; 4 were not run"]


def test_none_and_unknown_parsers():
    assert parse_tool_calls("none", ' <tool_call>{"name": "f"}</tool_call> ').calls == []
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("qwen-xml", "")
    assert tool_parser_names() == ["hermes", "llama3_json", "none"]


def test_calls_render_as_openai_tool_calls_for_chat_templates():
    rendered = render_tool_calls([ToolCall("call_0", "add", {"a": 1})])
    assert rendered == [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert json.loads(rendered[0]["function"]["arguments"]) == {"a": 1}
