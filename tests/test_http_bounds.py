"""HTTP framing a hostile client may try, on a served engine: heads over the
bounds however they arrive, a body framed two ways at once (request
smuggling), and a client that half-closes after its request."""

from __future__ import annotations

import json
import socket

import pytest
import trio
from helpers.server import serving
from helpers.waiting import in_thread

from trioserve.server.http import MAX_HEAD_BYTES

pytestmark = pytest.mark.fake_config(step_delay_s=0.001)


def exchange(port: int, raw: bytes, *, half_close: bool = False) -> bytes:
    """Send ``raw`` in one write, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while data := sock.recv(65536):
            received += data
        return received


def post(path: str, body: dict, *extra: str) -> bytes:
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join([*head, *extra]) + "\r\n\r\n").encode() + payload


async def test_heads_over_the_bounds_are_431_even_when_they_arrive_in_one_read(fake_config):
    async with serving(fake_config(), model_name="m") as server:
        assert server.port is not None
        big = f"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 4 * MAX_HEAD_BYTES}\r\n\r\n".encode()
        many = (
            "GET /health HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-{i}: y\r\n" for i in range(12_000)) + "\r\n"
        ).encode()
        with trio.fail_after(30):
            for raw in (big, many):
                answer = await in_thread(exchange, server.port, raw)
                assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
                assert b'"request_head_too_large"' in answer
            answer = await in_thread(
                exchange, server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            assert answer.startswith(b"HTTP/1.1 200 ")


async def test_a_body_framed_by_content_length_and_chunked_is_refused_and_the_connection_closed(fake_config):
    """CL.TE smuggling: a proxy that trusts Content-Length would take the
    second request for part of the first's body; it must never be served."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    chunked = b"0\r\n\r\n" + smuggled
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(chunked)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + chunked
    )
    async with serving(fake_config(), model_name="m") as server:
        assert server.port is not None
        with trio.fail_after(30):
            answer = await in_thread(exchange, server.port, raw)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"both Content-Length and Transfer-Encoding" in answer
    assert answer.count(b"HTTP/1.1 ") == 1  # the smuggled request got no answer: the connection closed


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_half_closes_after_its_request_gets_the_whole_response(fake_config, stream):
    request = post("/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 8, "stream": stream})
    async with serving(fake_config(), model_name="m") as server:
        assert server.port is not None
        with trio.fail_after(30):
            answer = await in_thread(lambda: exchange(server.port, request, half_close=True))
    assert answer.startswith(b"HTTP/1.1 200 ")
    if stream:
        assert answer.rstrip().endswith(b"0") and b"data: [DONE]" in answer
    else:
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("part", ["head", "body"])
async def test_a_head_or_body_that_misses_its_deadline_gets_a_408_then_the_connection_closes(fake_config, part):
    raw = post("/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 2})
    cut = raw.index(b"\r\n\r\n") + (4 + 5 if part == "body" else -10)  # in the head, or 5 bytes into the body

    def stall() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
            sock.sendall(raw[:cut])
            received = b""
            while data := sock.recv(65536):
                received += data
            return received

    async with serving(fake_config(), model_name="m", handshake_timeout_s=0.5) as server:
        with trio.fail_after(30):
            answer = await in_thread(stall)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer, answer[:300]
