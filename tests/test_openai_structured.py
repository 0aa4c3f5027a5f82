"""Structured outputs through the server (in-process, the fake runner, which
samples under the bitmask like a model): OpenAI's ``response_format`` and
vLLM's ``structured_outputs`` and ``guided_*`` through the official client,
streamed and not, the same on the WebSocket; every bad constraint a 400
naming its field while a request beside it completes."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
import trio
from helpers.fakes import SERVING
from helpers.server import Received, collect, expect_error, generate, open_ws, raw_request, serving, wait_blocks_free
from helpers.waiting import in_thread

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=20)


def streamed_text(stream: Any) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""
            finish = choice.finish_reason or finish
    return text, finish


async def test_the_official_client_gets_outputs_that_hold_to_each_kind_of_constraint(fake_config):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            api = client(server)
            chat = api.chat.completions.create
            whole = await in_thread(chat, model=MODEL, messages=MESSAGES, response_format=response_format)
            streamed = await in_thread(
                chat, model=MODEL, messages=MESSAGES, response_format=response_format, stream=True
            )
            streamed_person = await in_thread(streamed_text, streamed)
            any_object = await in_thread(  # the fake runner never closes a free string: only its start
                chat, model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=3
            )
            complete = api.completions.create
            regex = await in_thread(
                complete, model=MODEL, prompt="Phone:", extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}}
            )
            choice = await in_thread(
                complete, model=MODEL, prompt="Pick:", extra_body={"guided_choice": ["left", "right", "up"]}
            )
            guided = await in_thread(
                complete, model=MODEL, prompt="Who:", max_tokens=100, extra_body={"guided_json": json.dumps(PERSON)}
            )
            grammar = await in_thread(
                chat,
                model=MODEL,
                messages=MESSAGES,
                extra_body={"structured_outputs": {"grammar": 'root ::= "ok" | "no" [0-9]'}},
            )
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    assert streamed_person[1] == "stop" and json.loads(streamed_person[0]) == json.loads(
        whole.choices[0].message.content
    )
    assert any_object.choices[0].message.content.startswith('{"')
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    assert choice.choices[0].text in ("left", "right", "up")
    jsonschema.validate(json.loads(guided.choices[0].text), PERSON)
    assert re.fullmatch(r"ok|no[0-9]", grammar.choices[0].message.content)


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a"}},
            }
        },
        "response_format.json_schema.schema",
        "unclosed group",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format.json_schema.schema",
        "uniqueItems",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex parse error"),
    ({"structured_outputs": {}}, "structured_outputs", "give one of"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": {"$ref": "#/$defs/gone"}}, "guided_json", "does not exist"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one structured-output constraint"),
    ({"guided_json": {"enum": [f"value number {i:06d}" for i in range(4000)]}}, "guided_json", "at most 65536"),
]


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BAD.append(({"guided_json": deep_schema(40)}, "guided_json", "nests more than 32 levels deep"))


async def test_each_bad_constraint_is_a_400_naming_its_field_and_a_request_beside_completes(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            results: dict = {}

            async def beside() -> None:
                api = client(server)
                results["beside"] = await in_thread(
                    api.completions.create, model=MODEL, prompt="carry on", max_tokens=60, temperature=0
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(beside)
                for i, (extra, _, _) in enumerate(BAD):
                    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, **extra}
                    endpoint = "/v1/completions"
                    if i % 2:  # the chat endpoint takes the same fields
                        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **extra}
                        endpoint = "/v1/chat/completions"
                    status, _, payload = await in_thread(
                        raw_request, server, "POST", endpoint, json.dumps(body).encode()
                    )
                    error = json.loads(payload)["error"]
                    results[i] = (status, error["param"], error["message"])
            await wait_blocks_free(server)
    assert results["beside"].choices[0].finish_reason == "length" and len(results["beside"].choices[0].text) > 0
    for i, (_, param, message) in enumerate(BAD):
        status, got_param, got_message = results[i]
        assert (status, got_param) == (400, param), (i, results[i])
        assert message in got_message and got_message.startswith(param), (i, got_message)


async def test_the_websocket_protocol_takes_a_constraint_in_params_and_refuses_a_bad_one(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:

            def scenario() -> tuple[dict[str, Received], dict]:
                with open_ws(server.url) as ws:
                    running = {"beside": Received()}
                    ws.send(generate("beside", "carry on", max_tokens=40))
                    ws.send(generate("bad", "x", structured={"type": "regex", "pattern": "(x"}))
                    error = expect_error(ws, "invalid_field", "bad", running)
                    ws.send(generate("good", "x", structured={"type": "choice", "choices": ["yes", "no"]}))
                    return collect(ws, {"beside", "good"}, received=running)[0], error

            received, error = await in_thread(scenario)
    assert error["field"] == "params.structured" and error["message"].startswith("params.structured: ")
    assert "unclosed group" in error["message"]
    assert received["good"].text in ("yes", "no") and received["good"].terminal["finish_reason"] == "stop"  # type: ignore[index]
    assert received["beside"].terminal["type"] == "done"  # type: ignore[index]
