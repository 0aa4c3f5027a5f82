"""The WebSocket protocol's pure functions: parsing, validation, encoding, HTTP routing."""

from __future__ import annotations

import json

import pytest

from trioserve.messages import SampleLogprobs
from trioserve.sampling_params import SamplingParams
from trioserve.server import http, protocol
from trioserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, decode_body
from trioserve.server.protocol import Cancel, Delta, Generate, ProtocolError


def parse(message: object) -> Generate | Cancel:
    return protocol.parse_client_message(json.dumps(message))


def parse_error(frame: str | bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        protocol.parse_client_message(frame)
    return info.value


def test_generate_with_a_text_prompt_and_params():
    msg = parse({"type": "generate", "id": "r1", "prompt": "Hello", "params": {"max_tokens": 5, "temperature": 0}})
    assert msg == Generate(
        id="r1", prompt="Hello", prompt_token_ids=None, params=SamplingParams(max_tokens=5, temperature=0)
    )
    assert msg.prompt_field == "prompt"


def test_generate_with_token_ids_and_default_params():
    msg = parse({"type": "generate", "id": "r1", "prompt_token_ids": [1, 2, 3]})
    assert isinstance(msg, Generate)
    assert msg.prompt_token_ids == [1, 2, 3] and msg.prompt is None
    assert msg.params == SamplingParams()
    assert msg.prompt_field == "prompt_token_ids"


def test_cancel():
    assert parse({"type": "cancel", "id": "r1"}) == Cancel(id="r1")


@pytest.mark.parametrize(
    "frame",
    ["{bad", "", "[1, 2", '{"type": "generate"', "nul", b'{"type": "cancel", "id": "x"}'],
)
def test_malformed_json_and_binary_frames_are_invalid_json(frame):
    err = parse_error(frame)
    assert err.code == protocol.INVALID_JSON
    assert err.id is None


@pytest.mark.parametrize("value", [[1, 2], "hello", 3, None, True])
def test_a_message_that_is_not_an_object_is_invalid_json(value):
    err = parse_error(json.dumps(value))
    assert err.code == protocol.INVALID_JSON
    assert "JSON object" in err.message


def test_unknown_type_names_the_type_and_keeps_the_id():
    err = parse_error(json.dumps({"type": "complete", "id": "r9"}))
    assert err.code == protocol.UNKNOWN_TYPE
    assert err.message.startswith("type:") and "complete" in err.message
    assert err.id == "r9"


def test_missing_type_is_an_invalid_field():
    err = parse_error(json.dumps({"id": "r1", "prompt": "x"}))
    assert (err.code, err.field, err.id) == (protocol.INVALID_FIELD, "type", "r1")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"type": "generate", "prompt": "x"}, "id"),
        ({"type": "generate", "id": "", "prompt": "x"}, "id"),
        ({"type": "generate", "id": 7, "prompt": "x"}, "id"),
        ({"type": "generate", "id": "x" * 257, "prompt": "x"}, "id"),
        ({"type": "cancel"}, "id"),
        ({"type": "cancel", "id": ["a"]}, "id"),
        ({"type": "generate", "id": "a"}, "prompt"),
        ({"type": "generate", "id": "a", "prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"type": "generate", "id": "a", "prompt": 5}, "prompt"),
        ({"type": "generate", "id": "a", "prompt_token_ids": "1 2"}, "prompt_token_ids"),
        ({"type": "generate", "id": "a", "prompt_token_ids": {"0": 1}}, "prompt_token_ids"),
        ({"type": "generate", "id": "a", "prompt": ["x"]}, "prompt"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 2**64}}, "params.max_tokens"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"top_k": 10**20}}, "params.top_k"),
        (
            {"type": "generate", "id": "a", "prompt": "x", "params": {"stop_token_ids": [2**64]}},
            "params.stop_token_ids",
        ),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"stop": ["a"] * 65}}, "params.stop"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"stop": ["a" * 4097]}}, "params.stop"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": 1e300}}, "params.temperature"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": [1]}, "params"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 0}}, "params.max_tokens"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"logit_bias": {"x": 1}}}, "params.logit_bias"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"logit_bias": {"05": 1}}}, "params.logit_bias"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"logit_bias": {"-3": 1}}}, "params.logit_bias"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"min_tokens": 17}}, "params.min_tokens"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": "3"}}, "params.max_tokens"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 2.0}}, "params.max_tokens"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": -1}}, "params.temperature"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 0}}, "params.top_p"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"stop": [1]}}, "params.stop[0]"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"stop": [""]}}, "params.stop"),
        ({"type": "generate", "id": "a", "prompt": "x", "params": {"max_token": 3}}, "params.max_token"),
        ({"type": "generate", "id": "a", "prompt": "x", "stream": True}, "stream"),
        ({"type": "cancel", "id": "a", "reason": "bored"}, "reason"),
    ],
)
def test_a_missing_or_invalid_field_is_named(message, field):
    err = parse_error(json.dumps(message))
    assert err.code == protocol.INVALID_FIELD
    assert err.field == field
    assert err.message.startswith(f"{field}: "), err.message
    expected_id = message.get("id") if isinstance(message.get("id"), str) and message["id"] and field != "id" else None
    assert err.id == expected_id


def test_error_messages_carry_the_field_only_when_there_is_one():
    assert json.loads(protocol.encode(parse_error("{").to_message())) == {
        "type": "error",
        "id": None,
        "code": "invalid_json",
        "message": parse_error("{").message,
    }
    err = parse_error(json.dumps({"type": "generate", "id": "a", "prompt": 5}))
    assert json.loads(protocol.encode(err.to_message()))["field"] == "prompt"


def test_deep_nesting_is_invalid_json_not_a_crash():
    err = parse_error("[" * 100_000 + "]" * 100_000)
    assert (err.code, err.message) == (protocol.INVALID_JSON, "malformed JSON: nested too deeply")
    err = parse_error(json.dumps({"type": "generate", "id": "a", "prompt": "x", "junk": [[[[[[1]]]]]]}))
    assert err.field == "junk"


def test_a_lone_surrogate_is_an_invalid_string_not_truncated_input_on_both_apis():
    err = parse_error('{"type": "generate", "id": "a", "prompt": "x\\ud800y"}')
    assert err.code == protocol.INVALID_JSON
    assert "lone UTF-16 surrogate" in err.message and "truncated" not in err.message
    for kind, body in [
        (CompletionRequest, b'{"model": "m", "prompt": "a\\ud800b"}'),
        (ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}'),
    ]:
        with pytest.raises(OpenAIError) as http_err:
            decode_body(body, kind)
        assert http_err.value.status == 400 and http_err.value.code == "invalid_json"
        assert str(http_err.value) == "malformed JSON: invalid string: a \\u escape encodes a lone UTF-16 surrogate"
    with pytest.raises(OpenAIError, match="truncated"):  # what truncated input is still called
        decode_body(b'{"model": "m", "prompt": "a', CompletionRequest)


def test_malformed_json_is_told_in_msgspecs_words_without_its_prefix():
    """msgspec's message for malformed JSON starts "JSON is malformed: ",
    which both APIs leave out (``malformed_json_detail``): this fails when
    msgspec's wording changes."""
    with pytest.raises(OpenAIError) as http_err:
        decode_body(b"{bad", CompletionRequest)
    for message in (parse_error("{bad").message, http_err.value.message):
        assert message.startswith("malformed JSON: ") and "JSON is malformed" not in message, message


def test_echoed_client_values_are_cut_short():
    err = parse_error(json.dumps({"type": "x" * 100_000, "id": "a"}))
    assert err.code == protocol.UNKNOWN_TYPE and len(err.message) < 200
    err = parse_error(json.dumps({"type": "cancel", "id": "a", "k" * 100_000: 1}))
    assert err.field is not None and len(err.field) < 100


def test_server_messages_encode_as_documented():
    delta = Delta(id="a", text="hi", token_ids=[1, 2])
    assert json.loads(protocol.encode(delta)) == {"type": "delta", "id": "a", "text": "hi", "token_ids": [1, 2]}
    with_logprobs = Delta(id="a", text="", token_ids=[1], logprobs=[SampleLogprobs(-0.5, [1, 2], [-0.5, -1.0], 1)])
    assert json.loads(protocol.encode(with_logprobs))["logprobs"] == [[-0.5, [1, 2], [-0.5, -1.0], 1]]
    first = Delta(id="a", text="", token_ids=[1], prompt_logprobs=[SampleLogprobs(-2.0, [7], [-0.1], 3)])
    assert json.loads(protocol.encode(first))["prompt_logprobs"] == [[-2.0, [7], [-0.1], 3]]
    assert json.loads(protocol.encode(protocol.done("a", "stop", "\n", 3, 4))) == {
        "type": "done",
        "id": "a",
        "finish_reason": "stop",
        "stop_reason": "\n",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0},
    }
    assert json.loads(protocol.encode(protocol.error("a", "shutdown", "bye"))) == {
        "type": "error",
        "id": "a",
        "code": "shutdown",
        "message": "bye",
    }


# --- HTTP ----------------------------------------------------------------------


def head(method: str = "GET", target: str = "/", **headers: str) -> http.RequestHead:
    lines = [f"{method} {target} HTTP/1.1", "Host: x"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return http.parse_request_head(("\r\n".join(lines) + "\r\n\r\n").encode())


def test_parse_request_head_lowercases_header_names():
    parsed = head("GET", "/health?x=1", Upgrade="WebSocket", Authorization="Bearer k")
    assert parsed.method == "GET" and parsed.path == "/health"
    assert parsed.headers["upgrade"] == "WebSocket" and parsed.is_websocket_upgrade
    assert parsed.has_bearer_token("k") and not parsed.has_bearer_token("kk")


def test_an_api_key_outside_ascii_matches_the_same_key_sent_as_utf_8():
    """The header is decoded as latin-1: compared as text, a UTF-8 key sent by a client never matched."""
    parsed = head("GET", "/v1/models", Authorization="Bearer пароль")
    assert parsed.has_bearer_token("пароль")
    assert not parsed.has_bearer_token("парол") and not parsed.has_bearer_token("Ð¿Ð°ÑÐ¾Ð»Ñ")


def test_a_target_in_absolute_form_has_its_path():
    """RFC 9112, 3.2.2: a server takes ``POST http://host/path`` (found: it was answered 426)."""
    parsed = head("POST", "http://x:8000/v1/completions?a=1")
    assert (parsed.path, parsed.is_api) == ("/v1/completions", True)
    assert head("GET", "https://x").path == "/"


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/2\r\n\r\n", b"GET / HTTP/1.1\r\nno-colon\r\n\r\n"])
def test_parse_request_head_rejects_malformed_heads(raw):
    with pytest.raises(http.BadRequest):
        http.parse_request_head(raw)


@pytest.mark.parametrize(("phase", "status"), [("ready", 200), ("starting", 503), ("stopping", 503), ("dead", 503)])
def test_health_is_200_only_when_ready_and_needs_no_key(phase, status):
    reply = http.route(head("GET", "/health"), phase=phase, api_key="secret")
    assert reply is not None and reply.status == status and reply.body == {"status": phase}


def test_websocket_needs_the_api_key_when_one_is_set():
    ws = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "a2V5a2V5a2V5a2V5a2V5aw==",
        "Sec-WebSocket-Version": "13",
    }
    assert http.route(head(**ws), phase="ready", api_key=None) is None
    assert http.route(head(Authorization="Bearer secret", **ws), phase="ready", api_key="secret") is None
    for auth in ("", "Bearer wrong", "Basic secret", "Bearer"):
        reply = http.route(head(Authorization=auth, **ws), phase="ready", api_key="secret")
        assert reply is not None and reply.status == 401


def test_websocket_is_refused_with_503_unless_ready_and_plain_http_gets_404():
    ws = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "a2V5a2V5a2V5a2V5a2V5aw==",
        "Sec-WebSocket-Version": "13",
    }
    assert http.route(head(**ws), phase="starting", api_key=None).status == 503  # type: ignore[union-attr]
    assert http.route(head(**ws), phase="stopping", api_key=None).status == 503  # type: ignore[union-attr]
    not_found = http.route(head("GET", "/"), phase="ready", api_key=None)
    assert not_found is not None and not_found.status == 404 and not_found.body["error"]["code"] == "not_found"  # type: ignore[index]
    assert http.route(head("POST", "/health"), phase="ready", api_key=None).status == 405  # type: ignore[union-attr]
    bad = http.route(head(Upgrade="websocket", Connection="Upgrade"), phase="ready", api_key=None)
    assert bad is not None and bad.status == 400
    assert set(bad.body["error"]) == {"message", "type", "param", "code"}  # type: ignore[arg-type]  # OpenAI's


def test_response_is_complete_http():
    data = http.response(503, {"status": "starting"})
    assert data.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    headers, body = data.split(b"\r\n\r\n", 1)
    assert json.loads(body) == {"status": "starting"}
    assert f"Content-Length: {len(body)}".encode() in headers
    assert http.response(200, {"a": 1}, head_only=True).endswith(b"\r\n\r\n")


def test_an_id_that_is_not_a_valid_one_is_never_echoed():
    err = parse_error(json.dumps({"type": "nope", "id": "i" * 100_000}))
    assert err.code == protocol.UNKNOWN_TYPE and err.id is None
    err = parse_error(json.dumps({"type": "cancel", "id": "i" * 257}))
    assert err.field == "id" and err.id is None and len(err.message) < 200


# --- OpenAI logprobs: what each token stands for ------------------------------------------


def test_logprobs_give_each_tokens_own_bytes_offsets_by_character_and_leave_out_the_eos(tiny_model_dir):
    """The tiny model's vocabulary is byte-level (id 3 + byte): "a🎉b" is six
    tokens, four of them pieces of one character, then the EOS that ended the
    reply (not in the text, so not in its logprobs)."""
    from trioserve.frontend.text.tokenizer import Tokenizer
    from trioserve.gpu.tiny_models import EOS_ID
    from trioserve.server.openai_responses import TokenPlacer, chat_logprobs, completion_logprobs

    tokenizer = Tokenizer.from_dir(tiny_model_dir("llama"))
    ids = [3 + b for b in "a🎉b".encode()] + [EOS_ID]
    logprobs = [SampleLogprobs(-0.5, [t, 3 + ord("z")], [-0.5, -1.0]) for t in ids]
    whole = TokenPlacer(tokenizer)
    placed = whole.place(ids, logprobs, len("a🎉b"))
    assert whole.num_taken == 6  # the EOS, past the text, is never taken
    content = chat_logprobs(placed, tokenizer).content
    assert len(content) == 6
    assert b"".join(bytes(item.bytes) for item in content).decode() == "a🎉b"
    assert [item.token for item in content][:2] == ["a", "\ufffd"]  # a piece of a character alone
    assert content[1].top_logprobs[0].bytes == [0xF0] and content[1].top_logprobs[1].token == "z"
    legacy = completion_logprobs(placed, tokenizer)
    assert legacy.text_offset == [0, 1, 1, 1, 1, 2]  # each piece at its character's start
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 6
    # Streamed: the first chunk's text is "a" (the emoji's first bytes held back, unfinished); the
    # emoji's tokens come with the chunk whose text holds it.
    stream = TokenPlacer(tokenizer)
    assert completion_logprobs(stream.place(ids[:3], logprobs[:3], 1), tokenizer).text_offset == [0]
    assert completion_logprobs(stream.place(ids, logprobs, 3), tokenizer).text_offset == [1, 1, 1, 1, 2]


def test_logprobs_offsets_count_each_invalid_byte_as_its_replacement_and_stop_at_a_cut_text(tiny_model_dir):
    """Found: bytes that are no UTF-8 counted as no character (the text shows
    U+FFFD for each), so every later offset fell behind; the tokens of a stop
    string, which the text leaves out, were listed; and after a token whose
    text was held back in part, the next one was placed at its chunk's start."""
    from trioserve.frontend.text.tokenizer import Tokenizer
    from trioserve.server.openai_responses import TokenPlacer, completion_logprobs

    tokenizer = Tokenizer.from_dir(tiny_model_dir("llama"))

    def offsets(raw: bytes, *text_lengths: int) -> list[list[int]]:
        ids = [3 + b for b in raw]
        logprobs = [SampleLogprobs(-0.5, [t], [-0.5]) for t in ids]
        placer = TokenPlacer(tokenizer)
        return [completion_logprobs(placer.place(ids, logprobs, n), tokenizer).text_offset for n in text_lengths]

    assert b"\xffg\xfeg".decode(errors="replace") == "\ufffdg\ufffdg"
    assert offsets(b"\xffg\xfeg", 4) == [[0, 1, 2, 3]]
    # "abXYc" with the stop string "XY": the text is "ab"; the tokens past it are never taken.
    assert offsets(b"abXYc", 0, 2, 2) == [[], [0, 1], []]
    # "x", the start of a character that "f" breaks (shown as U+FFFD), then the stop string "f":
    # the text is "x\ufffd", and "f" starts past it.
    assert offsets(b"x\xc2f", 2) == [[0, 1]]

    class Words:  # a vocabulary of whole words, as real ones have
        all_special_ids: frozenset[int] = frozenset()
        pieces = (b"world", b",", b" how")

        def token_bytes(self, token_id: int) -> bytes:
            return self.pieces[token_id]

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            return b"".join(self.pieces[t] for t in token_ids).decode(errors="replace")

    # One token's text in two chunks: "wor" shown, "ld" held back (it may begin a stop string that
    # turns out not to be), then "ld, how": "," is at 5, not at its chunk's start (3).
    words = Words()
    placer = TokenPlacer(words)  # type: ignore[arg-type]
    ids, logprobs = [0, 1, 2], [SampleLogprobs(-0.5, [t], [-0.5]) for t in range(3)]
    first, second = placer.place(ids, logprobs, 3), placer.place(ids, logprobs, len("world, how"))
    assert completion_logprobs(first, words).text_offset == [0]  # type: ignore[arg-type]
    assert completion_logprobs(second, words).text_offset == [5, 6]  # type: ignore[arg-type]


def test_sampling_params_take_logit_bias_keys_as_json_writes_them():
    frame = {"type": "generate", "id": "a", "prompt": "x", "params": {"logit_bias": {"42": -100, "7": 2.5}}}
    message = protocol.parse_client_message(json.dumps(frame))
    assert isinstance(message, protocol.Generate) and message.params.logit_bias == {42: -100.0, 7: 2.5}
