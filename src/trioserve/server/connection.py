"""One WebSocket connection: a task group of a reader, a sender, a shutdown
watcher and one task per request.

Invariants:
- The sender is the only task that writes to the WebSocket. Everything else
  queues text frames in the outbox, a memory channel of
  ``ServerConfig.outbox_size`` frames.
- A request holds one of the connection's ``max_requests_per_connection``
  slots from the moment it is accepted until its terminal message (``done``
  or ``error``) is queued, so at most ``outbox_size`` frames, plus one
  blocked frame per request and one from the reader, wait for a client that
  does not read.
- Every accepted request queues exactly one terminal message, unless the
  connection goes away first (then it is only aborted in the engine).
- While a request waits for room in the outbox, its deltas merge in its
  ``RequestStream``, so the engine never waits for a client. A request that
  waits ``slow_consumer_timeout_s`` ends with ``slow_consumer`` and is aborted.
  A terminal message that waits as long again for room (a client that reads
  nothing at all) drops the connection: its slot is never held for good.
- The connection is idle while no request is in flight (from the end of the
  last one) and no client message came (pings do not count). Once idle for
  ``idle_timeout_s`` it is closed with ``IDLE_CLOSE_CODE``; the deadline of
  ``_idle_timer`` is always "last activity + idle_timeout_s", or infinite
  while a request is in flight.
- Once the close frame is queued (``_closing``), client messages are ignored:
  the close frame answers them.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trioserve.api import Engine
from trioserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestError,
)
from trioserve.frontend.requests.streams import RequestStream
from trioserve.sampling_params import SamplingParams
from trioserve.server import protocol
from trioserve.server.config import ServerConfig
from trioserve.server.protocol import Cancel, Delta, Embed, Embedding, Generate, ProtocolError, ServerMessage, Usage
from trioserve.server.state import ServerState, wait_any

log = logging.getLogger("trioserve.server")
IDLE_CLOSE_CODE = 4408  # application range (4000-4999); 408 as in HTTP's Request Timeout


@dataclass(frozen=True)
class _Close:
    """Queued after the last terminal message: the sender closes the WebSocket."""

    code: int
    reason: str


@dataclass(eq=False)
class _Flight:
    """A request in flight on this connection."""

    request: Generate | Embed
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    end_code: str | None = None  # set when the server ends it early; None: the client cancelled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Connection:
    def __init__(self, ws: WebSocketConnection, engine: Engine, state: ServerState, config: ServerConfig) -> None:
        self._ws = ws
        self._engine = engine
        self._client_id = f"ws-{secrets.token_hex(4)}"  # the engine admits waiting requests by client in turn
        self._state = state
        self._config = config
        self._flights: dict[str, _Flight] = {}
        self._num_slots = 0
        self._idle = trio.Event()
        self._idle.set()
        self._closing = False
        self._idle_timer = trio.CancelScope(deadline=trio.current_time() + config.idle_timeout_s)
        self._sender_done = trio.Event()
        self._outbox_send, self._outbox_receive = trio.open_memory_channel[str | _Close](config.outbox_size)

    async def run(self) -> None:
        """Serve the connection until the client leaves or the server stops.

        When the client disconnects (or the connection is cancelled), every
        request it had in flight is aborted in the engine and its KV blocks
        are freed; nothing is left running.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_loop, nursery)
            nursery.start_soon(self._drain_on_stop, nursery)
            nursery.start_soon(self._close_when_idle, nursery)
            await self._read_loop(nursery)
            if not self._closing:  # the client left (or broke the protocol): abort everything
                nursery.cancel_scope.cancel()

    # --- the reader -----------------------------------------------------------

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        """Read and act on client messages until the WebSocket closes. While
        the outbox is full, a reply waits, and so does reading (backpressure).
        If cancelled, no request is left half-registered."""
        while True:
            try:
                frame = await self._ws.get_message()
            except ConnectionClosed:
                return
            if self._num_slots == 0:
                self._idle_timer.deadline = trio.current_time() + self._config.idle_timeout_s
            reply = self._handle(frame, nursery)
            if reply is not None:
                await self._outbox_send.send(protocol.encode(reply))

    def _handle(self, frame: str | bytes, nursery: trio.Nursery) -> ServerMessage | None:
        if self._closing:
            return None
        try:
            message = protocol.parse_client_message(frame)
        except ProtocolError as exc:
            if exc.id is not None and exc.id in self._flights:
                # Not that request's end (it carries on): the error names the id in its text only.
                note = f" (this message named id {exc.id!r}, a request in flight, which carries on)"
                return ProtocolError(exc.code, exc.message + note, field=exc.field).to_message()
            return exc.to_message()
        if isinstance(message, Cancel):
            flight = self._flights.get(message.id)
            if flight is not None:  # else it already ended (or never was): nothing to do
                flight.scope.cancel()
            return None
        return self._start(message, nursery)

    def _start(self, request: Generate | Embed, nursery: trio.Nursery) -> ServerMessage | None:
        if self._state.stopping.is_set():
            why = "the engine died" if self._state.stop_code == protocol.ENGINE_DEAD else "the server is shutting down"
            return protocol.error(request.id, self._state.stop_code, f"not started: {why}")
        if request.id in self._flights:
            return ProtocolError(
                protocol.DUPLICATE_ID,
                f"id: {request.id!r} is already in flight on this connection (that request carries on)",
                id=request.id,
                field="id",
            ).to_message()
        if self._num_slots >= self._config.max_requests_per_connection:
            return protocol.error(
                request.id,
                protocol.TOO_MANY_REQUESTS,
                f"this connection already has {self._num_slots} requests in flight "
                f"(max_requests_per_connection is {self._config.max_requests_per_connection})",
            )
        flight = _Flight(request)
        self._flights[request.id] = flight
        if self._num_slots == 0:
            self._idle = trio.Event()
            self._idle_timer.deadline = float("inf")
        self._num_slots += 1
        nursery.start_soon(self._run_request, flight, nursery.cancel_scope)
        return None

    # --- the sender and the shutdown watcher -------------------------------

    async def _send_loop(self, nursery: trio.Nursery) -> None:
        """Write queued frames to the WebSocket, in order; close it when told.
        If the client is gone, cancel the whole connection. If cancelled, a
        frame may be left half-written: that only happens when the connection
        is being dropped anyway."""
        try:
            async for item in self._outbox_receive:
                if isinstance(item, _Close):
                    await self._ws.aclose(item.code, item.reason)
                    return
                await self._ws.send_message(item)
        except ConnectionClosed:
            nursery.cancel_scope.cancel()
        finally:
            self._sender_done.set()

    async def _drain_on_stop(self, nursery: trio.Nursery) -> None:
        """When the server stops: let requests finish until the grace is over,
        end the rest (``shutdown`` or ``engine_dead``), flush, close the
        WebSocket with the server's close code, then end the connection. A
        client that does not read within ``close_timeout_s`` is dropped."""
        await self._state.stopping.wait()
        await wait_any(self._idle, self._state.grace_over)
        for flight in self._flights.values():
            flight.end_code = self._state.stop_code
            flight.scope.cancel()
        with trio.move_on_after(self._config.close_timeout_s):
            await self._idle.wait()
            await self._send_close(self._state.close_code, self._state.close_reason)
        nursery.cancel_scope.cancel()

    async def _close_when_idle(self, nursery: trio.Nursery) -> None:
        """Once the connection has been idle for ``idle_timeout_s``, close it
        with ``IDLE_CLOSE_CODE`` (after the frames already queued), then end
        it; a client that does not take the close frame within
        ``close_timeout_s`` is dropped. If the server stops first, the close
        is ``_drain_on_stop``'s. Cancelling leaves nothing behind."""
        with self._idle_timer:
            await self._state.stopping.wait()
        if not self._idle_timer.cancelled_caught:
            return
        log.debug("closing a connection idle for %gs", self._config.idle_timeout_s)
        with trio.move_on_after(self._config.close_timeout_s):
            await self._send_close(IDLE_CLOSE_CODE, f"idle for {self._config.idle_timeout_s:g}s")
        nursery.cancel_scope.cancel()

    async def _send_close(self, code: int, reason: str) -> None:
        """Queue the close frame (once) and wait until the sender has sent it.
        If cancelled, the close frame may not have been sent."""
        if not self._closing:
            self._closing = True
            await self._outbox_send.send(_Close(code, reason))
        await self._sender_done.wait()

    # --- one request --------------------------------------------------------

    async def _run_request(self, flight: _Flight, connection: trio.CancelScope) -> None:
        """Run one request and queue its terminal message. If cancelled (the
        connection is going away), the request is aborted in the engine, its
        KV blocks are freed, and nothing more is queued. If the terminal
        message finds no room for ``slow_consumer_timeout_s``, the client
        reads nothing: ``connection`` is cancelled (it is dropped)."""
        request_id = flight.request.id
        try:
            with flight.scope:
                terminal = await self._generate(flight)
            if flight.scope.cancelled_caught:
                terminal = self._ended_early(flight)
            self._forget(flight)
            with trio.move_on_after(self._config.slow_consumer_timeout_s) as waited:
                await self._outbox_send.send(protocol.encode(terminal))
            if waited.cancelled_caught:
                log.debug(
                    "dropping a connection that read nothing for %gs while request %r's last message waited",
                    self._config.slow_consumer_timeout_s,
                    request_id,
                )
                connection.cancel()
        finally:
            self._forget(flight)
            self._num_slots -= 1
            if self._num_slots == 0:
                self._idle.set()
                self._idle_timer.deadline = trio.current_time() + self._config.idle_timeout_s
            log.debug("request %r ended", request_id)

    def _forget(self, flight: _Flight) -> None:
        if self._flights.get(flight.request.id) is flight:
            del self._flights[flight.request.id]

    def _ended_early(self, flight: _Flight) -> ServerMessage:
        request_id = flight.request.id
        if flight.end_code is None:  # the client's cancel
            return protocol.done(
                request_id, "abort", None, flight.prompt_tokens, flight.completion_tokens, flight.cached_tokens
            )
        if flight.end_code == protocol.ENGINE_DEAD:
            return protocol.error(request_id, protocol.ENGINE_DEAD, "the engine died")
        return protocol.error(request_id, flight.end_code, "the server is shutting down; the request was ended")

    async def _generate(self, flight: _Flight) -> ServerMessage:
        """Run the request through the engine, which checks it. Returns its
        terminal message. If cancelled, the request is aborted in the engine."""
        request = flight.request
        try:
            if isinstance(request, Embed):
                out = await self._engine.encode(
                    request.the_prompt, dimensions=request.dimensions, normalize=request.normalize,
                    client_id=self._client_id,
                )  # fmt: skip
                usage = Usage(out.num_prompt_tokens, 0, out.num_cached_tokens or 0)
                return Embedding(id=request.id, embedding=out.embedding, usage=usage)
            if request.params.structured is not None:
                await self._engine.check_structured(request.params.structured)
            stream = self._engine.stream(request.the_prompt, request.params, client_id=self._client_id)
            return await self._stream(flight, stream)
        except InvalidRequestError as exc:  # the engine's checks: "field: message"
            return _invalid_request(request, exc).to_message()
        except EngineOverloadedError as exc:
            return protocol.error(request.id, protocol.OVERLOADED, str(exc))
        except EngineDeadError as exc:  # the engine restarts (the server watches for it failing for good)
            return protocol.error(request.id, protocol.ENGINE_DEAD, str(exc))
        except RequestError as exc:
            return protocol.error(request.id, protocol.REQUEST_FAILED, str(exc))
        except Exception:
            log.exception("request %r failed", request.id)
            return protocol.error(request.id, protocol.INTERNAL, "internal server error (see the server's log)")

    async def _stream(self, flight: _Flight, stream: RequestStream) -> ServerMessage:
        """Forward the request's deltas to the outbox until it finishes. Leaving
        early (slow consumer, cancellation) aborts it in the engine."""
        request_id = flight.request.id
        resumes = isinstance(flight.request, Generate) and flight.request.include_resumes
        async with stream:
            flight.prompt_tokens = stream.num_prompt_tokens
            async for out in stream:
                flight.cached_tokens = out.num_cached_tokens or 0
                if out.text or out.token_ids:
                    delta = Delta(
                        id=request_id,
                        text=out.text,
                        token_ids=out.token_ids,
                        logprobs=out.logprobs,
                        prompt_logprobs=out.prompt_logprobs,
                        num_resumes=out.num_resumes if resumes else None,
                    )
                    if not await self._queue_delta(protocol.encode(delta)):
                        return protocol.error(
                            request_id,
                            protocol.SLOW_CONSUMER,
                            f"the client read nothing for {self._config.slow_consumer_timeout_s:g}s "
                            "while this request's messages waited; the request was ended",
                        )
                # Counted once queued: a `done` after a cancel counts only the tokens the client got.
                flight.completion_tokens = out.num_output_tokens
                if out.finish_reason is not None:
                    return protocol.done(
                        request_id,
                        out.finish_reason,
                        out.stop_reason,
                        out.num_prompt_tokens,
                        out.num_output_tokens,
                        out.num_cached_tokens or 0,
                        out.num_resumes if resumes else None,
                    )
        raise RuntimeError("the stream ended without a finished output")

    async def _queue_delta(self, frame: str) -> bool:
        """Queue a delta; False if the outbox stayed full for the slow-consumer
        bound (then the frame was not queued). If cancelled, it was not queued."""
        with trio.move_on_after(self._config.slow_consumer_timeout_s):
            await self._outbox_send.send(frame)
            return True
        return False


def _invalid_request(request: Generate | Embed, exc: InvalidRequestError) -> ProtocolError:
    """The protocol's error for the engine's: the engine names the field
    ``prompt`` whichever way it was given, and a sampling parameter without
    its ``params.``; the client gets its own name."""
    field, message = exc.field, str(exc)
    if field == "prompt":
        field = request.prompt_field
        message = field + message.removeprefix("prompt")
    elif field in SamplingParams.__struct_fields__:
        field = f"params.{field}"
        message = "params." + message
    code = protocol.PROMPT_TOO_LONG if isinstance(exc, PromptTooLongError) else protocol.INVALID_FIELD
    return ProtocolError(code, message, id=request.id, field=field)
