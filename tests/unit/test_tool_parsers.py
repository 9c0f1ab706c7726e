"""Tool-call parsers against model turns in the formats real models write (Hermes/Qwen
`<tool_call>` blocks, Llama 3.x JSON), including the broken and cut-off ones."""

from __future__ import annotations

import json

import pytest

from rlmesh.rollout.agents import tool_parsers
from rlmesh.rollout.agents.tool_parsers import (
    MAX_ARGUMENTS_BYTES,
    MAX_CALLS_PER_TURN,
    ParsedTurn,
    ToolCall,
    parse_tool_calls,
    register_tool_parser,
    render_tool_calls_for_template,
    tool_parser_names,
)

# Each row: (text, finish_reason, content, calls as [(name, arguments)], error substrings in order, truncated).
HERMES = {
    "single call, as Qwen writes it": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "stop",
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
        [],
        False,
    ),
    "several calls after text": (
        'I will look both up.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "y"}}\n</tool_call>',
        "stop",
        "I will look both up.",
        [("search", {"q": "x"}), ("search", {"q": "y"})],
        [],
        False,
    ),
    "text before and after": (
        'Adding.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nThen I answer.',
        "stop",
        "Adding.\nThen I answer.",
        [("add", {"a": 1, "b": 2})],
        [],
        False,
    ),
    "Qwen3 thinking before the call stays in the content": (
        '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "stop",
        "<think>\nI need the weather.\n</think>",
        [("get_weather", {})],
        [],
        False,
    ),
    "arguments as JSON text": (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "stop",
        "",
        [("add", {"a": 1})],
        [],
        False,
    ),
    "empty arguments text": (
        '<tool_call>{"name": "now", "arguments": ""}</tool_call>',
        "stop",
        "",
        [("now", {})],
        [],
        False,
    ),
    "parameters key accepted": (
        '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>',
        "stop",
        "",
        [("add", {"a": 1})],
        [],
        False,
    ),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', "stop", "", [("now", {})], [], False),
    "closing tag inside an argument string": (
        '<tool_call>{"name": "echo", "arguments": {"text": "a</tool_call>b"}}</tool_call>',
        "stop",
        "",
        [("echo", {"text": "a</tool_call>b"})],
        [],
        False,
    ),
    "malformed JSON": (
        '<tool_call>{"name": "add", "arguments": {"a": 1 "b": 2}}</tool_call>',
        "stop",
        "",
        [],
        ["tool call 1 is not valid JSON: Expecting ',' delimiter at char 37"],
        False,
    ),
    "one good call, one malformed": (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {,}}</tool_call>',
        "stop",
        "",
        [("a", {})],
        ["tool call 2 is not valid JSON"],
        False,
    ),
    "a stray closing brace": (
        '<tool_call>{"name": "a", "arguments": {}}}</tool_call>',
        "stop",
        "",
        [],
        ["tool call 1 is not valid JSON: Extra data"],
        False,
    ),
    "missing name": (
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        "stop",
        "",
        [],
        ['tool call 1 has no "name"'],
        False,
    ),
    "name that is not an identifier": (
        '<tool_call>{"name": "rm -rf /", "arguments": {}}</tool_call>',
        "stop",
        "",
        [],
        ['tool call 1: name "rm -rf /" may only use letters, digits'],
        False,
    ),
    "name too long": (
        '<tool_call>{"name": "' + "f" * 129 + '", "arguments": {}}</tool_call>',
        "stop",
        "",
        [],
        ["tool call 1: its name is 129 characters long; at most 128"],
        False,
    ),
    "arguments not an object": (
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        "stop",
        "",
        [],
        ['tool call 1 (add): "arguments" must be a JSON object, not list'],
        False,
    ),
    "arguments text that is not JSON": (
        '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
        "stop",
        "",
        [],
        ['tool call 1 (add): "arguments" is a string that is not valid JSON'],
        False,
    ),
    "call that is not an object": (
        '<tool_call>["add", {"a": 1}]</tool_call>',
        "stop",
        "",
        [],
        ["tool call 1 must be a JSON object"],
        False,
    ),
    "cut off by the token limit": (
        'Let me add.\n<tool_call>\n{"name": "add", "argum',
        "length",
        "Let me add.",
        [],
        ["tool call 1 was cut off by the token limit and was not run"],
        True,
    ),
    "cut off just before the closing tag": (
        '<tool_call>{"name": "add", "arguments": {}}',
        "length",
        "",
        [],
        ["tool call 1 was cut off"],
        True,
    ),
    "complete call, then one cut off": (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": "lo',
        "length",
        "",
        [("a", {})],
        ["tool call 2 was cut off"],
        True,
    ),
    "never closed, though the model stopped": (
        '<tool_call>{"name": "add", "arguments": {}}',
        "stop",
        "",
        [],
        ["tool call 1 was not closed with </tool_call> and was not run"],
        False,
    ),
    "never closed before the next call": (
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "stop",
        "",
        [("b", {})],
        ["tool call 1 was not closed"],
        False,
    ),
    "plain text": ("The answer is 4.", "stop", "The answer is 4.", [], [], False),
    "plain text cut off": ("The answer is", "length", "The answer is", [], [], False),
}

LLAMA3 = {
    "python_tag and one call": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "stop",
        "",
        [("get_weather", {"city": "Paris"})],
        [],
        False,
    ),
    "one call without the tag": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "stop",
        "",
        [("get_weather", {"city": "Paris"})],
        [],
        False,
    ),
    "arguments key accepted": ('{"name": "add", "arguments": {"a": 1}}', "stop", "", [("add", {"a": 1})], [], False),
    "arguments as JSON text": (
        '{"name": "add", "parameters": "{\\"a\\": 1}"}',
        "stop",
        "",
        [("add", {"a": 1})],
        [],
        False,
    ),
    "';' separated calls": (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}};'
        '{"name": "c", "parameters": {}}',
        "stop",
        "",
        [("a", {}), ("b", {"x": 1}), ("c", {})],
        [],
        False,
    ),
    "';' inside an argument string": (
        '{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {"s": "};{"}}',
        "stop",
        "",
        [("a", {"s": "x;y"}), ("b", {"s": "};{"})],
        [],
        False,
    ),
    "calls on separate lines without ';'": (
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
        "stop",
        "",
        [("a", {}), ("b", {})],
        [],
        False,
    ),
    "text after a ';' is content": (
        '{"name": "a", "parameters": {}}; that is all',
        "stop",
        "that is all",
        [("a", {})],
        [],
        False,
    ),
    "text before the tag and after the calls": (
        'Checking.<|python_tag|>{"name": "a", "parameters": {}}\nDone.',
        "stop",
        "Checking.\nDone.",
        [("a", {})],
        [],
        False,
    ),
    "cut off by the token limit": (
        '<|python_tag|>{"name": "a", "parameters": {"city": "Par',
        "length",
        "",
        [],
        ["tool call 1 was cut off by the token limit and was not run"],
        True,
    ),
    "cut off without the tag": ('{"name": "a", "parameters": {', "length", "", [], ["tool call 1 was cut off"], True),
    "cut off right after the tag": ("<|python_tag|>", "length", "", [], ["tool call 1 was cut off"], True),
    "complete call, then one cut off": (
        '{"name": "a", "parameters": {}}; {"name": "b", "par',
        "length",
        "",
        [("a", {})],
        ["tool call 2 was cut off"],
        True,
    ),
    "malformed JSON after the tag": (
        '<|python_tag|>{"name": "a", "parameters": {]}',
        "stop",
        "",
        [],
        ["tool call 1 is not valid JSON: Expecting property name enclosed in double quotes at char 29"],
        False,
    ),
    "malformed call without the tag": (
        '{"name": "a", "parameters": {"x": 1,}}',
        "stop",
        "",
        [],
        ["tool call 1 is not valid JSON"],
        False,
    ),
    "second call malformed": (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {]}',
        "stop",
        "",
        [("a", {})],
        ["tool call 2 is not valid JSON"],
        False,
    ),
    "missing name": ('<|python_tag|>{"parameters": {"a": 1}}', "stop", "", [], ['tool call 1 has no "name"'], False),
    "built-in tool syntax after the tag": (
        '<|python_tag|>brave_search.call(query="weather")',
        "stop",
        "",
        [],
        ["tool call 1 after <|python_tag|> must be a JSON object"],
        False,
    ),
    "plain text": ("Paris is sunny today.", "stop", "Paris is sunny today.", [], [], False),
    "plain text cut off": ("Paris is", "length", "Paris is", [], [], False),
    "braces that are not JSON": ("{not json, just braces}", "stop", "{not json, just braces}", [], [], False),
    "a JSON answer is not a call": ('{"answer": 42}', "stop", '{"answer": 42}', [], [], False),
    "a JSON answer with a name is not a call": (
        '{"name": "Ada", "born": 1815}',
        "stop",
        '{"name": "Ada", "born": 1815}',
        [],
        [],
        False,
    ),
    "a JSON answer cut off is not a call": ('{"answer": 4', "length", '{"answer": 4', [], [], False),
}


def _check(turn: ParsedTurn, content, calls, errors, truncated) -> None:
    assert turn.content == content
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == len(errors), turn.errors
    for error, expected in zip(turn.errors, errors):
        assert expected in error
    assert turn.truncated == truncated
    assert [c.id for c in turn.calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(
    ("text", "finish", "content", "calls", "errors", "truncated"), list(HERMES.values()), ids=list(HERMES)
)
def test_hermes(text, finish, content, calls, errors, truncated):
    _check(parse_tool_calls("hermes", text, finish), content, calls, errors, truncated)


@pytest.mark.parametrize(
    ("text", "finish", "content", "calls", "errors", "truncated"), list(LLAMA3.values()), ids=list(LLAMA3)
)
def test_llama3_json(text, finish, content, calls, errors, truncated):
    _check(parse_tool_calls("llama3_json", text, finish), content, calls, errors, truncated)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        '<|python_tag|>{"name": "f", "parameters": {}}',
    ],
)
def test_none_parser_leaves_every_turn_as_content(text):
    assert parse_tool_calls("none", f"  {text}\n", "stop") == ParsedTurn(content=text)


def _hermes_calls(count: int) -> str:
    return "\n".join(f'<tool_call>{{"name": "f", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(count))


def _llama3_calls(count: int) -> str:
    return "; ".join(f'{{"name": "f", "parameters": {{"i": {i}}}}}' for i in range(count))


@pytest.mark.parametrize(("parser", "write_calls"), [("hermes", _hermes_calls), ("llama3_json", _llama3_calls)])
def test_calls_past_the_bound_are_not_run_and_are_reported(parser, write_calls):
    full = parse_tool_calls(parser, write_calls(MAX_CALLS_PER_TURN), "stop")
    assert len(full.calls) == MAX_CALLS_PER_TURN and full.errors == []

    over = parse_tool_calls(parser, write_calls(MAX_CALLS_PER_TURN + 4), "stop")
    assert [c.arguments["i"] for c in over.calls] == list(range(MAX_CALLS_PER_TURN))
    assert over.errors == [
        f"tool call {MAX_CALLS_PER_TURN + 1} and any after it were not run: "
        f"at most {MAX_CALLS_PER_TURN} tool calls per turn"
    ]
    assert over.content == ""


@pytest.mark.parametrize("as_text", [False, True])
def test_arguments_over_the_size_bound_are_refused(as_text):
    arguments = {"text": "x" * MAX_ARGUMENTS_BYTES}
    value = json.dumps(json.dumps(arguments)) if as_text else json.dumps(arguments)
    turn = parse_tool_calls("hermes", f'<tool_call>{{"name": "write", "arguments": {value}}}</tool_call>', "stop")
    assert turn.calls == []
    assert turn.errors == [f"tool call 1 (write): its arguments are longer than {MAX_ARGUMENTS_BYTES} bytes of JSON"]


def test_ids_count_the_calls_run_and_keep_a_usable_id_the_model_gave():
    text = (
        '<tool_call>{"name": "a", "arguments": {,}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "call_1", "name": "c", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "bad id!", "name": "d", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "call_1", "name": "e", "arguments": {}}</tool_call>'
    )
    turn = parse_tool_calls("hermes", text, "stop")
    assert [(c.name, c.id) for c in turn.calls] == [("b", "call_0"), ("c", "call_1"), ("d", "call_2"), ("e", "call_3")]
    assert [e.split(" is ")[0] for e in turn.errors] == ["tool call 1"]


def test_parsing_is_deterministic():
    text = _hermes_calls(3)
    assert parse_tool_calls("hermes", text, "stop") == parse_tool_calls("hermes", text, "stop")


def test_unknown_parser_names_the_known_ones():
    assert {"hermes", "llama3_json", "none"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match=r"unknown tool parser 'qwen-xml'; known parsers: .*hermes.*llama3_json"):
        parse_tool_calls("qwen-xml", "hi", "stop")


def test_parsers_register_by_name_once(monkeypatch):
    monkeypatch.setattr(tool_parsers, "_PARSERS", dict(tool_parsers._PARSERS))

    @register_tool_parser("shout")
    def shout(text: str, finish_reason: str | None) -> ParsedTurn:
        return ParsedTurn(content=text.upper())

    assert "shout" in tool_parser_names()
    assert parse_tool_calls("shout", "hi", "stop").content == "HI"
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("shout")(shout)


def test_calls_render_as_openai_tool_calls():
    rendered = render_tool_calls_for_template(
        [ToolCall("call_0", "add", {"a": 1}), ToolCall("call_1", "say", {"text": "héllo"})]
    )
    assert rendered == [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "call_1", "type": "function", "function": {"name": "say", "arguments": '{"text": "héllo"}'}},
    ]


def test_calls_render_with_dict_arguments_for_templates_that_tojson_them():
    turn = parse_tool_calls("hermes", _hermes_calls(2), "stop")
    rendered = render_tool_calls_for_template(turn.calls, arguments_as_dict=True)
    assert [r["function"]["arguments"] for r in rendered] == [{"i": 0}, {"i": 1}]
    rendered[0]["function"]["arguments"]["i"] = 9  # the parsed call is not changed through the rendering
    assert turn.calls[0].arguments == {"i": 0}


def test_parsed_calls_round_trip_through_rendering():
    text = '<tool_call>{"name": "search", "arguments": {"q": "a \\"quoted\\" ü", "n": [1, 2]}}</tool_call>'
    turn = parse_tool_calls("hermes", text, "stop")
    (entry,) = render_tool_calls_for_template(turn.calls)
    assert entry["function"]["name"] == "search"
    assert json.loads(entry["function"]["arguments"]) == {"q": 'a "quoted" ü', "n": [1, 2]}


@pytest.mark.parametrize(
    ("parser", "template"), [("hermes", "<tool_call>{}</tool_call>"), ("llama3_json", "<|python_tag|>{}")]
)
def test_json_nested_too_deeply_is_an_error_not_a_crash(parser, template):
    deep = '{"name": "f", "arguments": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}"
    turn = parse_tool_calls(parser, template.format(deep), "stop")
    assert turn.calls == []
    assert turn.errors == ["tool call 1 is not valid JSON: nested too deeply at char 0"]
