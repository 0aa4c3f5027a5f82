"""One HTTP connection (``server/http_conn.py``) over in-memory streams, on
Trio's virtual clock: every write, the hand-written answer to a malformed
request head included, is bounded by ``send_timeout_s``."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trioserve.server.http import BadRequest
from trioserve.server.http_conn import HttpConnection

HEADS = {
    "malformed head": b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",  # answered by hand: h11 will not frame it
    "whole response": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("answer", list(HEADS))
async def test_an_answer_the_client_never_reads_fails_after_exactly_the_send_timeout(
    autojump_clock: Any, answer: str
) -> None:
    server_stream, client_stream = trio.testing.lockstep_stream_pair()  # no buffer: a client that reads nothing
    conn = HttpConnection(server_stream, max_body_bytes=1 << 20, send_timeout_s=1.5)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_stream.send_all, HEADS[answer])
            if answer == "malformed head":
                with pytest.raises(BadRequest, match="malformed request") as bad:
                    await conn.read_head()
                began = trio.current_time()
                with pytest.raises(trio.TooSlowError):
                    await conn.send_error_and_close(bad.value)
            else:
                assert await conn.read_head() is not None
                began = trio.current_time()
                with pytest.raises(trio.TooSlowError):
                    await conn.send_json(200, {"x": 1})
            assert trio.current_time() - began == 1.5
            nursery.cancel_scope.cancel()
