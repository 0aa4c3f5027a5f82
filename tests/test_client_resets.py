"""A client that resets its connection in the middle of a stream (SSE over
HTTP, or a WebSocket) has gone away: that is one debug line at most, never
an error with a traceback that a client could repeat to fill the log."""

from __future__ import annotations

import json
import logging
import socket
import struct

import pytest
import trio
from helpers.server import serving
from helpers.waiting import in_thread

pytestmark = pytest.mark.fake_config(step_delay_s=0.002, num_kv_blocks=4096)

STREAMS = [
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
]


def reset_during_a_stream(port: int, path: str, body: bytes, after: int) -> None:
    """Start a streamed completion, read ``after`` bytes of it, then reset (RST) the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    received = b""
    while len(received) < after:
        received += sock.recv(after - len(received))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a reset
    sock.close()


async def test_resets_in_the_middle_of_sse_streams_log_no_error_and_the_server_serves_on(fake_config, caplog):
    caplog.set_level(logging.DEBUG, logger="trioserve")
    with trio.fail_after(60):
        async with serving(fake_config(), model_name="m") as server:
            assert server.engine is not None and server.port is not None
            for i in range(40):
                path, fields = STREAMS[i % 2]
                body = {"model": "m", "max_tokens": 100_000, "ignore_eos": True, "stream": True, **fields}
                # Reset at every point: in the response head, after it, a few chunks in.
                await in_thread(reset_during_a_stream, server.port, path, json.dumps(body).encode(), 1 + 37 * i)
            with trio.fail_after(10):
                while server.engine.num_requests_in_flight():  # every one was aborted
                    await trio.sleep(0.02)
            errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert errors == [], [r.getMessage() for r in errors]
