"""Tool calls: the tools a request offers, checked; the schema of a forced
call; the calls found in what a model wrote, whole or streamed in any
pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.errors import InvalidRequestError
from trioserve.server.tool_calls import (
    CallDelta,
    Function,
    Parsed,
    check_tools,
    chosen_function,
    forced_calls,
    open_stream,
    parse,
    required_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tools_are_checked_and_a_bad_one_is_named():
    functions = check_tools([WEATHER, TIME])
    assert [f.name for f in functions] == ["get_weather", "get_time"]
    assert functions[0].parameters["required"] == ["city"]
    bad = [
        ({"type": "retrieval"}, "tools[0].type"),
        ({"type": "function"}, "tools[0].function"),
        ({"type": "function", "function": {"name": "has space"}}, "tools[0].function.name"),
        ({"type": "function", "function": {"name": "x" * 65}}, "tools[0].function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": "object"}}, "tools[0].function.parameters"),
    ]
    for tool, field in bad:
        with pytest.raises(InvalidRequestError) as raised:
            check_tools([tool])
        assert raised.value.field == field
    with pytest.raises(InvalidRequestError, match="offered twice"):
        check_tools([WEATHER, WEATHER])
    with pytest.raises(InvalidRequestError, match="at most 128"):
        check_tools([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)])


def test_tool_choice_names_an_offered_function_or_is_a_400_naming_the_field():
    functions = check_tools([WEATHER, TIME])
    assert chosen_function("auto", functions) == "auto"
    assert chosen_function("required", functions) == "required"
    named = chosen_function({"type": "function", "function": {"name": "get_time"}}, functions)
    assert isinstance(named, Function) and named.name == "get_time"
    with pytest.raises(InvalidRequestError) as raised:
        chosen_function({"type": "function", "function": {"name": "launch"}}, functions)
    assert raised.value.field == "tool_choice.function.name" and "'get_weather', 'get_time'" in str(raised.value)
    with pytest.raises(InvalidRequestError, match="needs at least one tool"):
        chosen_function("required", [])
    with pytest.raises(InvalidRequestError) as raised:
        chosen_function("always", functions)
    assert raised.value.field == "tool_choice"


def test_the_output_forced_by_required_or_a_name_becomes_calls():
    functions = check_tools([WEATHER, TIME])
    schema = required_schema(functions)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    )
    calls = forced_calls("required", text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id
    (call,) = forced_calls(functions[0], '{"city": "Oslo"}')
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert forced_calls(functions[0], '{"city": "Os') == []  # cut short by max_tokens


def test_hermes_blocks_are_calls_and_the_text_before_them_is_content():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    parsed = parse("hermes", text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert parse("hermes", "Just text, <b>no</b> calls.") == Parsed("Just text, <b>no</b> calls.", [])


def test_what_does_not_parse_stays_content_and_an_unclosed_block_at_the_end_is_a_call_if_it_parses():
    broken = 'A <tool_call>{"name": "get_weather", "arguments": {</tool_call> B'
    assert parse("hermes", broken).content == broken and parse("hermes", broken).tool_calls == []
    unclosed = parse("hermes", '<tool_call>{"name": "get_time", "arguments": {}}')
    assert unclosed.content is None and [c.name for c in unclosed.tool_calls] == ["get_time"]
    assert parse("hermes", "<tool_call>{").content == "<tool_call>{"


def test_llama3_json_calls_and_content():
    parsed = parse(
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
    )
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert parsed.content is None
    assert parse("llama3_json", "  The weather is fine.").content == "  The weather is fine."
    assert parse("llama3_json", '{"not": "a call"}').content == '{"not": "a call"}'


REPLIES = [
    "Plain text with < and <tool and <tool_call without a block.",
    'Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and <tool_call>{"name": "b", "arguments": {}}'
    "</tool_call> done",
    '<tool_call>{"name": "a", "arguments": {"s": "</tool"}}</tool_call><tool_call>{bad}</tool_call>',
    '<|python_tag|>{"name": "a", "parameters": {"y": [1, 2]}}',
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"z": "é"}}',
    "<|python",
]


@settings(max_examples=200, deadline=None)
@given(
    parser=st.sampled_from(["hermes", "llama3_json"]),
    reply=st.sampled_from(REPLIES),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_a_stream_in_any_pieces_gives_what_the_whole_reply_gives(parser, reply, cuts):
    stream = open_stream(parser)
    pieces, at = [], 0
    for cut in sorted(set(cuts)):
        pieces += stream.feed(reply[at:cut])
        at = max(at, cut)
    pieces += stream.feed(reply[at:])
    pieces += stream.finish()
    whole = parse(parser, reply)
    calls = [p for p in pieces if isinstance(p, CallDelta)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [(c.call.name, c.call.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    text = "".join(p for p in pieces if isinstance(p, str))
    assert ((text.strip() if calls else text) or None) == whole.content
    if not calls:
        assert text == reply  # nothing is lost
