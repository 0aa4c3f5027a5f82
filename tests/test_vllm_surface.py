"""The HTTP surface a vLLM user's clients expect: fields they send that this
server does not use are ignored, ``/tokenize`` and ``/detokenize``,
``/version`` and ``/ping``, a 404 with OpenAI's error object for an unknown
path, and CORS for a browser UI on another origin."""

from __future__ import annotations

import json

import pytest
import trio
from helpers.server import raw_request, serving
from helpers.waiting import in_thread
from openai import OpenAI

MODEL = "tiny-llama"
ERROR_KEYS = {"message", "type", "param", "code"}


def call(server, method: str, path: str, body: object = None, **headers: str) -> tuple[int, dict[str, str], dict]:
    raw = b"" if body is None else json.dumps(body).encode()
    status, answer_headers, payload = raw_request(server, method, path, raw, headers=headers)
    return status, answer_headers, json.loads(payload) if payload.strip().startswith(b"{") else {}


async def test_the_openai_client_with_fields_this_server_ignores_succeeds(fake_config):
    extra = {"metadata": {"user": "u1"}, "store": False, "reasoning_effort": "low", "chat_template_kwargs": {}}
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            client = OpenAI(base_url=server.http_url, api_key="x", max_retries=0, timeout=30)
            chat = await in_thread(
                lambda: client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4,
                    user="someone",
                    extra_body=extra,
                )
            )
            completion = await in_thread(
                lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=extra)
            )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert completion.usage is not None and completion.usage.completion_tokens == 4


async def test_tokenize_and_detokenize_round_trip_and_name_what_is_wrong(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, api_key="k") as server:
            auth = {"Authorization": "Bearer k"}
            status, _, tokenized = await in_thread(call, server, "POST", "/tokenize", {"prompt": "Hello there"}, **auth)
            assert status == 200 and tokenized["count"] == len(tokenized["tokens"]) > 0
            assert tokenized["max_model_len"] > 0
            body = {"model": MODEL, "tokens": tokenized["tokens"]}
            status, _, detokenized = await in_thread(call, server, "POST", "/detokenize", body, **auth)
            assert (status, detokenized["prompt"].removeprefix("<s>").strip()) == (200, "Hello there")
            messages = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}
            status, _, chat = await in_thread(call, server, "POST", "/tokenize", messages, **auth)
            assert server.engine is not None
            rendered = await server.engine.render_chat([{"role": "user", "content": "Hi"}])
            assert (status, chat["tokens"]) == (200, await server.engine.tokenize(rendered))
            for body, param in (({"tokens": [10**9]}, "tokens"), ({}, "prompt"), ({"tokens": "x"}, "tokens")):
                path = "/tokenize" if "tokens" not in body else "/detokenize"
                status, _, error = await in_thread(call, server, "POST", path, body, **auth)
                assert status == 400 and error["error"]["param"] == param, error
            status, _, error = await in_thread(call, server, "POST", "/tokenize", {"prompt": "x"})
            assert status == 401 and set(error["error"]) == ERROR_KEYS  # the tokenizer is behind the key


async def test_version_ping_and_an_unknown_path_as_vllm_answers_them(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, api_key="k") as server:
            status, _, version = await in_thread(call, server, "GET", "/version")
            assert status == 200 and isinstance(version["version"], str)
            for method in ("GET", "POST"):
                assert (await in_thread(call, server, method, "/ping"))[0] == 200
            for method, path in (("GET", "/nope"), ("POST", "/v2/completions"), ("GET", "/"), ("GET", "/docs")):
                status, _, error = await in_thread(call, server, method, path)
                assert status == 404 and set(error["error"]) == ERROR_KEYS and error["error"]["code"] == "not_found"
            status, _, error = await in_thread(call, server, "POST", "/health")
            assert status == 405 and set(error["error"]) == ERROR_KEYS


PREFLIGHT = {
    "Origin": "https://ui.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.mark.parametrize("origins", [("https://ui.example",), ("*",)])
async def test_a_browser_preflight_gets_the_cors_headers_and_the_request_its_origin(fake_config, origins):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, api_key="k", allowed_origins=origins) as server:
            status, headers, _ = await in_thread(call, server, "OPTIONS", "/v1/chat/completions", None, **PREFLIGHT)
            assert status == 200  # no API key: a browser never sends one with a preflight
            assert headers["access-control-allow-origin"] == ("*" if origins == ("*",) else "https://ui.example")
            assert "POST" in headers["access-control-allow-methods"]
            assert headers["access-control-allow-headers"] == "authorization, content-type"
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            auth = {"Authorization": "Bearer k", "Origin": "https://ui.example"}
            status, headers, _ = await in_thread(call, server, "POST", "/v1/completions", body, **auth)
            assert status == 200 and headers["access-control-allow-origin"] in ("*", "https://ui.example")
            other = {**PREFLIGHT, "Origin": "https://evil.example"}
            status, headers, error = await in_thread(call, server, "OPTIONS", "/v1/completions", None, **other)
            if origins == ("*",):
                assert status == 200
            else:
                assert status == 400 and "not allowed" in error["error"]["message"]
                assert "access-control-allow-origin" not in headers


async def test_without_allowed_origins_there_is_no_cors(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            status, headers, _ = await in_thread(call, server, "OPTIONS", "/v1/models", None, **PREFLIGHT)
            assert status == 400 and "access-control-allow-origin" not in headers
            status, headers, _ = await in_thread(call, server, "GET", "/v1/models", None, Origin="https://ui.example")
            assert status == 200 and "access-control-allow-origin" not in headers
