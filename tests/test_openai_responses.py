"""The OpenAI API's responses on the wire: exact JSON (keys, their order, nulls, left-out keys)."""

from __future__ import annotations

import json
from typing import Any

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.messages import SampleLogprobs
from trioserve.server import http, sse
from trioserve.server import openai_responses as resp
from trioserve.server.openai_protocol import OpenAIError


class Bytes:
    """A tokenizer whose token ``t`` is the byte ``t``; 0 is special."""

    all_special_ids = frozenset({0})

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t or not skip_special_tokens).decode(errors="replace")


def wire(body: dict[str, Any]) -> bytes:
    """``body`` as Python's ``json`` writes it, keys in the order written."""
    return json.dumps(body).encode()


def hi(finish_reason: str | None, cached: int | None) -> RequestOutput:
    """ "hi" with the logprobs of both tokens ("!" the runner-up of the second)."""
    logprobs = [SampleLogprobs(-0.25, [104], [-0.25]), SampleLogprobs(-0.5, [105, 33], [-0.5, -1.0])]
    return RequestOutput("r", "hi", [104, 105], "hi", 3, 2, finish_reason, None, logprobs, 0, cached)


def chat() -> tuple[sse.ChatFormat, sse.Choices, RequestOutput]:
    fmt = sse.chat_format("m", Bytes())  # type: ignore[arg-type]
    fmt.id, fmt.created = "chatcmpl-1", 1700000000
    choices, out = sse.Choices(1), hi("stop", cached=2)
    choices.add(out)
    return fmt, choices, out


CHAT_LOGPROBS = {
    "content": [
        {
            "token": "h",
            "logprob": -0.25,
            "bytes": [104],
            "top_logprobs": [{"token": "h", "logprob": -0.25, "bytes": [104]}],
        },
        {
            "token": "i",
            "logprob": -0.5,
            "bytes": [105],
            "top_logprobs": [
                {"token": "i", "logprob": -0.5, "bytes": [105]},
                {"token": "!", "logprob": -1.0, "bytes": [33]},
            ],
        },
    ]
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
CHAT_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def test_a_whole_chat_completion_is_exactly_this_json():
    fmt, choices, _ = chat()
    assert http.encode_json(fmt.response(choices, 3)) == wire(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "logprobs": CHAT_LOGPROBS,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi"},
                }
            ],
            "usage": USAGE,
        }
    )


def test_chat_chunks_send_usage_null_only_when_asked_and_the_role_only_first():
    fmt, choices, out = chat()
    opening = {"index": 0, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant", "content": ""}}
    assert http.encode_json(fmt.opening(1, include_usage=True)[0]) == wire(
        {**CHAT_HEAD, "choices": [opening], "usage": None}
    )
    assert http.encode_json(fmt.opening(1, include_usage=False)[0]) == wire({**CHAT_HEAD, "choices": [opening]})
    content = {"index": 0, "logprobs": CHAT_LOGPROBS, "finish_reason": "stop", "delta": {"content": "hi"}}
    assert http.encode_json(fmt.chunk(out, choices, include_usage=False)) == wire({**CHAT_HEAD, "choices": [content]})
    assert http.encode_json(fmt.usage_chunk(choices, 3)) == wire({**CHAT_HEAD, "choices": [], "usage": USAGE})


def test_a_completion_chunk_and_the_whole_completion_are_exactly_this_json():
    fmt = sse.completion_format("m", Bytes())  # type: ignore[arg-type]
    fmt.id, fmt.created = "cmpl-1", 1700000000
    choices, out = sse.Choices(1), hi("length", cached=None)
    choices.add(out)
    choice = {
        "index": 0,
        "logprobs": {
            "tokens": ["h", "i"],
            "token_logprobs": [-0.25, -0.5],
            "top_logprobs": [{"h": -0.25}, {"i": -0.5, "!": -1.0}],
            "text_offset": [0, 1],
        },
        "finish_reason": "length",
        "text": "hi",
    }
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m"}
    assert http.encode_json(fmt.chunk(out, choices, include_usage=True)) == wire(
        {**head, "choices": [choice], "usage": None}
    )
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}
    assert http.encode_json(fmt.response(choices, 3)) == wire({**head, "choices": [choice], "usage": usage})


def test_errors_and_models_are_exactly_this_json():
    assert http.encode_json(OpenAIError(400, "n: must be positive", param="n", code="invalid_value").body()) == wire(
        {
            "error": {
                "message": "n: must be positive",
                "type": "invalid_request_error",
                "param": "n",
                "code": "invalid_value",
            }
        }
    )
    assert http.encode_json(http.BadRequest("too big", 413).body()) == wire(
        {"error": {"message": "too big", "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    )
    model = {
        "id": "m",
        "object": "model",
        "created": 7,
        "owned_by": "trioserve",
        "max_model_len": 64,
        "task": "embed",
        "parent": None,
    }
    assert http.encode_json(resp.Model(id="m", created=7, max_model_len=64, task="embed")) == wire(model)
    assert http.encode_json(resp.EngineHealth(health="ready")) == wire({"health": "ready"})
