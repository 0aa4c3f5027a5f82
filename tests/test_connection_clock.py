"""One WebSocket connection (``server/connection.py``) over in-memory
streams, on Trio's virtual clock: the slow-consumer limit and the shutdown
grace, at exact times.

The engine is a fake whose requests produce a delta every ``DELTA_S`` of
virtual time. The two ends of the WebSocket are trio-websocket over a
lockstep stream pair, so a client that stops reading stops the server's
writes, as a real socket with full buffers would.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import trio
import trio.testing
from trio_websocket import WebSocketConnection, wrap_client_stream, wrap_server_stream

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.server.config import ServerConfig
from trioserve.server.connection import Connection
from trioserve.server.state import ServerState

DELTA_S = 0.125  # binary fractions: sums of virtual times stay exact


class FakeStream:
    """A ``RequestStream``'s face: a delta every ``DELTA_S``, ``n`` of them
    (forever when None); notes when each was taken and when it was left."""

    def __init__(self, request_id: str, n: int | None, log: list[tuple[str, float]]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = 3
        self._n = n
        self._i = 0
        self._log = log

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._log.append(("left", trio.current_time()))

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._n is not None and self._i >= self._n:
            raise StopAsyncIteration
        await trio.sleep(DELTA_S)
        self._i += 1
        self._log.append(("delta", trio.current_time()))
        last = self._n is not None and self._i == self._n
        return RequestOutput(self.request_id, "x", [1], "x" * self._i, 3, self._i, "length" if last else None)


class FakeEngine:
    def __init__(self, n: int | None = None) -> None:
        self.n = n
        self.log: list[tuple[str, float]] = []

    def stream(self, prompt: object, params: object, *, client_id: str = "") -> FakeStream:
        return FakeStream("r", self.n, self.log)


@asynccontextmanager
async def connection(
    engine: FakeEngine, state: ServerState, config: ServerConfig, ended: list[float] | None = None
) -> AsyncIterator[WebSocketConnection]:
    """A ``Connection`` serving ``engine``; yields the client's WebSocket.
    When the server's side ends, the time goes in ``ended``."""
    server_stream, client_stream = trio.testing.lockstep_stream_pair()
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            request = await wrap_server_stream(nursery, server_stream, message_queue_size=1)
            ws = await request.accept()
            await Connection(ws, engine, state, config).run()  # type: ignore[arg-type]
            if ended is not None:
                ended.append(trio.current_time())

        nursery.start_soon(serve)
        client = await wrap_client_stream(nursery, client_stream, "localhost", "/", message_queue_size=1)
        yield client
        nursery.cancel_scope.cancel()


def generate(request_id: str = "r") -> str:
    return json.dumps({"type": "generate", "id": request_id, "prompt": "hi"})


async def test_a_client_that_stops_reading_has_its_request_ended_after_exactly_the_slow_consumer_limit(
    autojump_clock: Any,
) -> None:
    engine, state = FakeEngine(), ServerState()
    config = ServerConfig(outbox_size=4, slow_consumer_timeout_s=3.0)
    async with connection(engine, state, config) as client:
        await client.send_message(generate())
        while not any(what == "left" for what, _ in engine.log):
            await trio.sleep(1.0)  # never reads
        last_delta = max(t for what, t in engine.log if what == "delta")
        left = next(t for what, t in engine.log if what == "left")
        # The last delta it took could not be queued: the request waited exactly the limit, then ended.
        assert left == last_delta + 3.0
        messages = []
        while True:  # now read what was queued: the deltas, then the terminal error
            message = json.loads(await client.get_message())
            messages.append(message)
            if message["type"] != "delta":
                break
        assert messages[-1]["code"] == "slow_consumer" and messages[-1]["id"] == "r"


async def test_a_client_that_never_reads_again_is_dropped_once_its_error_waits_as_long_again(
    autojump_clock: Any,
) -> None:
    """Its request ended, its slot must not be held for good (that would keep
    the connection, one of the server's ``max_connections``, forever)."""
    engine, state, ended = FakeEngine(), ServerState(), list[float]()
    config = ServerConfig(outbox_size=4, slow_consumer_timeout_s=3.0, idle_timeout_s=60.0)
    with trio.fail_after(50):  # virtual seconds; the idle timeout (60 s) never comes into it
        async with connection(engine, state, config, ended) as client:
            await client.send_message(generate())
            while not ended:
                await trio.sleep(1.0)  # never reads
    left = next(t for what, t in engine.log if what == "left")
    assert ended == [left + 3.0]


async def test_a_request_still_running_when_the_grace_ends_is_ended_at_exactly_its_deadline(
    autojump_clock: Any,
) -> None:
    engine, state = FakeEngine(), ServerState()
    config = ServerConfig(shutdown_grace_s=5.0625, close_timeout_s=1.0)  # not a multiple of DELTA_S: no tie
    async with trio.open_nursery() as nursery:
        nursery.start_soon(state.run_grace_timer)
        async with connection(engine, state, config) as client:
            await client.send_message(generate())
            assert json.loads(await client.get_message())["type"] == "delta"
            began = trio.current_time()
            state.begin_shutdown(config.shutdown_grace_s)
            messages = []
            while (message := json.loads(await client.get_message()))["type"] == "delta":
                messages.append(message)
            assert message == {
                "type": "error", "id": "r", "code": "shutdown",
                "message": "the server is shutting down; the request was ended",
            }  # fmt: skip
            assert [t for what, t in engine.log if what == "left"] == [began + 5.0625]
            assert len(messages) == 40  # it kept streaming through the grace: 5.0 / DELTA_S deltas
            assert (await _close_code(client)) == 1001
        nursery.cancel_scope.cancel()


async def test_a_request_that_finishes_within_the_grace_completes_and_the_connection_closes_then(
    autojump_clock: Any,
) -> None:
    engine, state = FakeEngine(n=20), ServerState()  # 20 deltas: 2.5 s
    config = ServerConfig(shutdown_grace_s=5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(state.run_grace_timer)
        async with connection(engine, state, config) as client:
            await client.send_message(generate())
            await client.get_message()
            began = trio.current_time()
            state.begin_shutdown(config.shutdown_grace_s)
            while (message := json.loads(await client.get_message()))["type"] == "delta":
                pass
            assert message["type"] == "done" and message["finish_reason"] == "length"
            assert trio.current_time() == began + 19 * DELTA_S  # the first delta came before the shutdown
            assert (await _close_code(client)) == 1001
        nursery.cancel_scope.cancel()


async def _close_code(client: WebSocketConnection) -> int | None:
    """Wait for the server to close the WebSocket; its close code."""
    from trio_websocket import ConnectionClosed

    try:
        while True:
            await client.get_message()
    except ConnectionClosed as closed:
        return closed.reason.code


async def test_a_bad_message_naming_a_request_in_flight_is_refused_without_its_id_and_the_request_carries_on(
    autojump_clock: Any,
) -> None:
    engine, state = FakeEngine(n=6), ServerState()
    with trio.fail_after(30):
        async with connection(engine, state, ServerConfig()) as client:
            await client.send_message(generate())
            assert json.loads(await client.get_message())["type"] == "delta"
            await client.send_message(json.dumps({"type": "cancel", "id": "r", "oops": 1}))
            messages = []
            while (message := json.loads(await client.get_message()))["type"] != "done":
                messages.append(message)
    errors = [m for m in messages if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["id"] is None and errors[0]["field"] == "oops"
    assert errors[0]["message"].startswith("oops: unknown field") and "'r', a request in flight" in errors[0]["message"]
    assert message["finish_reason"] == "length" and message["usage"]["completion_tokens"] == 6


async def test_a_done_after_a_cancel_counts_only_the_tokens_the_client_was_sent(autojump_clock: Any) -> None:
    """The client reads nothing until its outbox is full and a delta waits for
    room; then it cancels: that delta is dropped, and not counted."""
    engine, state = FakeEngine(), ServerState()
    config = ServerConfig(outbox_size=2, slow_consumer_timeout_s=100.0)
    with trio.fail_after(60):
        async with connection(engine, state, config) as client:
            await client.send_message(generate())
            await trio.sleep(5.0)  # deltas every 0.125 s: the outbox filled long ago
            await client.send_message(json.dumps({"type": "cancel", "id": "r"}))
            tokens = 0
            while (message := json.loads(await client.get_message()))["type"] == "delta":
                tokens += len(message["token_ids"])
    taken = sum(1 for what, _ in engine.log if what == "delta")
    assert message["finish_reason"] == "abort"
    assert message["usage"]["completion_tokens"] == tokens < taken  # the last one taken never went out
