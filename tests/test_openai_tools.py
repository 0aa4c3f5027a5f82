"""Tool calling through the server and the official ``openai`` client (in
process, the fake runner, which samples under the structured-output bitmask
like a model): ``tool_choice`` "required" and a named function constrain
the output to a valid call, streamed and not; "auto" reads the model's own
calls with ``--tool-call-parser`` (here the output is held to a Hermes call
by a regex, so that the fake model writes one); a transcript with calls and
tool results renders through a template that knows tools; each bad input a
400 naming its field while a request beside it completes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import trio
from helpers.fakes import SERVING
from helpers.server import post_json, serving, wait_blocks_free
from helpers.waiting import in_thread
from openai.types.chat import ChatCompletionChunk

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Renders the tools and every call and result of a transcript (as a tool-aware model's template does).
TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} [for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"\}\}</tool_call>'


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=20)


def check_call(call: Any) -> None:
    """A well-formed call of one of TOOLS: an id, a name offered, arguments that validate."""
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def joined_calls(chunks: list[ChatCompletionChunk]) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """A stream's calls as a client joins them (by index), its finish reason and content."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += (piece.function.name if piece.function else None) or ""
                call["arguments"] += (piece.function.arguments if piece.function else None) or ""
    return calls, finish, content


async def test_required_and_a_named_function_give_valid_calls_streamed_and_not(fake_config):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            chat = client(server).chat.completions.create
            required = await in_thread(
                lambda: chat(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200)
            )
            forced = await in_thread(
                lambda: chat(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200)
            )
            streams = {}
            for name, choice in (("required", "required"), ("named", named)):
                stream = await in_thread(
                    lambda c=choice: chat(
                        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=c, max_tokens=200, stream=True
                    )
                )
                streams[name] = await in_thread(list, stream)
            await wait_blocks_free(server)
    message = required.choices[0].message
    assert required.choices[0].finish_reason == "tool_calls" and message.content is None
    assert 1 <= len(message.tool_calls) <= 16
    for call in message.tool_calls:
        check_call(call)
    message = forced.choices[0].message
    assert forced.choices[0].finish_reason == "stop"  # as OpenAI's, for a named function
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    check_call(message.tool_calls[0])
    calls, finish, content = joined_calls(streams["required"])
    assert finish == "tool_calls" and content == "" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    calls, finish, content = joined_calls(streams["named"])
    assert finish == "stop" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    # A named function's arguments stream as they come: more than one piece.
    pieces = [p for c in streams["named"] for ch in c.choices for p in ch.delta.tool_calls or []]
    assert len(pieces) > 1 and pieces[0].id and all(p.id is None for p in pieces[1:])


async def test_auto_reads_the_models_own_hermes_call_and_plain_text_stays_content(fake_config):
    # The regex makes the fake model write a Hermes call, as a model trained for tools would.
    hold = {"structured_outputs": {"regex": r"Sure\. " + HERMES_CALL}}
    with trio.fail_after(60):
        async with serving(
            fake_config(), model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes"
        ) as server:
            chat = client(server).chat.completions.create
            called = await in_thread(
                lambda: chat(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=hold)
            )
            stream = await in_thread(
                lambda: chat(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=hold, stream=True)
            )
            chunks = await in_thread(list, stream)
            plain = await in_thread(
                lambda: chat(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=5)
            )
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "utc"})
    ]
    check_call(message.tool_calls[0])
    calls, finish, content = joined_calls(chunks)
    assert finish == "tool_calls" and content.strip() == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "utc"})]
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length"


async def test_a_transcript_with_calls_and_results_is_replayed_through_a_template_that_knows_tools(fake_config):
    transcript = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]
    with trio.fail_after(60):
        async with serving(fake_config(chat_template=TEMPLATE), model_name=MODEL) as server:
            reply = await in_thread(
                lambda: client(server).chat.completions.create(
                    model=MODEL, messages=transcript, tools=TOOLS, tool_choice="none", max_tokens=4
                )
            )
            status, body = await in_thread(post_json, server, "/tokenize", {"messages": transcript, "tools": TOOLS})
            assert status == 200, body
            status, text = await in_thread(post_json, server, "/detokenize", {"tokens": body["tokens"]})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None
    rendered = text["prompt"]
    assert rendered.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>' in rendered
    assert "tool: 18 C, clear [for call_1]" in rendered and rendered.endswith("assistant: ")


BAD = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS[:1] * 2, "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default, and this server has no parser
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/x"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
            ]
        },
        "messages[0].tool_calls",
    ),
]


async def test_each_bad_tool_input_is_a_400_naming_its_field_and_a_request_beside_completes(fake_config):
    with trio.fail_after(90):
        async with serving(fake_config(), model_name=MODEL) as server:
            api = client(server)
            for extra, param in BAD:
                body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
                beside: list[Any] = []

                async def request_beside(beside: list[Any] = beside) -> None:
                    small = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
                    beside.append(await in_thread(post_json, server, "/v1/chat/completions", small))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(request_beside)
                    status, answer = await in_thread(post_json, server, "/v1/chat/completions", body)
                assert beside[0][0] == 200 and beside[0][1]["choices"][0]["finish_reason"] == "length", beside
                assert status == 400, (extra, answer)
                assert answer["error"]["param"] == param, (extra, answer)
                assert answer["error"]["message"].startswith(param), answer
            done = await in_thread(lambda: api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3))
            assert done.choices[0].finish_reason == "length"
            await wait_blocks_free(server)
