"""One HTTP/1.1 connection over h11: the async shell that moves its bytes.

h11 parses and frames; this class only reads and writes. Invariants:

- A request head is at most ``http.MAX_HEAD_BYTES`` with at most
  ``MAX_HEADERS`` fields, however it arrives (431 beyond), a body at most
  ``max_body_bytes`` (a larger one is answered 413 and the connection
  closed); the deadlines for reading them are the caller's.
- A request with both ``Content-Length`` and ``Transfer-Encoding`` is
  refused (400) and its connection closed (RFC 9112, 6.3): a proxy in front
  that framed it by the other header would see another request in its body.
- A client that half-closes its side (``shutdown(SHUT_WR)``) after its
  request still gets the whole response (its connection then closes); only
  a reset, or a failed write, is a client gone.
- Exactly one task reads the socket at a time: the caller while it reads a
  request, else ``watch_disconnect``, which buffers what a pipelining client
  sends next (at most ``MAX_PIPELINED_BYTES``) and notices its EOF.
- A response is either whole (``send_json``, ``send_text``) or streamed
  (``start_stream``, ``send_data``..., ``end_stream``); h11 frames the
  stream with chunked transfer coding (close-delimited for HTTP/1.0).
- A body comes in at most ``MAX_BODY_PIECES`` pieces (chunks, or reads of
  the socket), parsed with a checkpoint every ``CHECKPOINT_EVERY``, so no
  body costs the event loop more than a fraction of a second.
- Every write is bounded: a client that takes none of ``SEND_PIECE_BYTES``
  for ``send_timeout_s`` gets ``trio.TooSlowError`` (the connection is to
  be closed), so a client that never reads cannot hold its connection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

import h11
import trio

from trioserve.server.http import MAX_HEAD_BYTES, BadRequest, ReplayStream, RequestHead, encode_json, response

RECEIVE_BYTES = 64 * 1024
MAX_HEADERS = 128  # fields in one request head
MAX_PIPELINED_BYTES = 64 * 1024  # what a client may send ahead while its request is served
SEND_PIECE_BYTES = 64 * 1024  # a write is bounded in time per piece of this size
LINGER_S = 2.0  # after an error answer, how long to read on what the client still sends ...
LINGER_BYTES = 16 * 1024 * 1024  # ... and how much of it, before closing
# Every piece of a body is one h11 event parsed on the event loop (tens of
# microseconds): a body of thousands of one-byte chunks would cost seconds.
MAX_BODY_PIECES = 4096  # a body in more pieces is refused (400)
CHECKPOINT_EVERY = 256  # pieces parsed between two yields to the other tasks
SERVER_HEADER = (b"Server", b"trioserve")


class HttpConnection:
    """The server side of one connection. Build it on an accepted stream;
    the caller closes the stream."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_body_bytes: int,
        send_timeout_s: float = float("inf"),
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.stream = stream
        self.max_body_bytes = max_body_bytes
        self.send_timeout_s = send_timeout_s
        self._closing = closing  # True when the caller will close the connection after this response
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._request: h11.Request | None = None
        self.num_requests = 0
        self.response_headers: list[tuple[str, str]] = []  # on every response to this request (CORS)
        self.status: int | None = None  # this request's response status, once its head is sent
        self.log_fields: dict[str, object] = {}  # what the access log says of this request beside its status

    @property
    def can_keep_alive(self) -> bool:
        """True when the last response is complete and the connection may carry another request."""
        return self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE

    @property
    def has_partial_head(self) -> bool:
        """True when part of a request head has arrived, and not the rest."""
        return self._h11.their_state is h11.IDLE and bool(self._h11.trailing_data[0])

    @property
    def response_started(self) -> bool:
        """True once this request's response has begun (its head is sent)."""
        return self._h11.our_state is not h11.SEND_RESPONSE

    async def read_head(self) -> RequestHead | None:
        """The next request's head, or None if the client closed the
        connection before sending one. Raises ``BadRequest`` for a malformed
        or oversized head. If cancelled, the connection is to be closed."""
        if self._h11.our_state is h11.DONE:
            self._h11.start_next_cycle()
        event = await self._next_event()
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):  # pragma: no cover - h11 gives a Request first
            raise BadRequest(f"unexpected {type(event).__name__}")
        _check_head(event)
        self.response_headers = []
        self.status = None
        self.log_fields = {}
        self._request = event
        self.num_requests += 1
        return RequestHead.from_h11(event)

    async def read_body(self) -> bytes:
        """The request's body (up to ``max_body_bytes``). Raises
        ``BadRequest`` (413 when too large). If cancelled, the connection is
        to be closed."""
        length = self._declared_length()
        if length is not None and length > self.max_body_bytes:
            raise BadRequest(f"request body of {length} bytes is larger than {self.max_body_bytes}", status=413)
        if self._h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
        body = bytearray()
        pieces = 0
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.max_body_bytes:
                    raise BadRequest(f"request body larger than {self.max_body_bytes} bytes", status=413)
                pieces += 1
                if pieces > MAX_BODY_PIECES:
                    raise BadRequest(f"request body in more than {MAX_BODY_PIECES} pieces (chunks)")
                if pieces % CHECKPOINT_EVERY == 0:
                    await trio.lowlevel.checkpoint()
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise BadRequest("connection closed before the end of the request body")

    async def finish_request(self) -> None:
        """Read and drop whatever of the request's body was not read (at most
        ``max_body_bytes``; beyond that, or on a malformed body, the
        connection cannot be kept alive). Returns at once for a request
        without a body, or when the response is not complete (the connection
        closes anyway). If cancelled, the connection is to be closed."""
        if self._h11.our_state is not h11.DONE:
            return
        dropped = pieces = 0
        try:
            while self._h11.their_state is h11.SEND_BODY and dropped <= self.max_body_bytes:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    dropped += len(event.data)
                    pieces += 1
                    if pieces > MAX_BODY_PIECES:
                        return
                    if pieces % CHECKPOINT_EVERY == 0:
                        await trio.lowlevel.checkpoint()
                elif not isinstance(event, h11.EndOfMessage):
                    return
        except BadRequest:
            return

    def _declared_length(self) -> int | None:
        assert self._request is not None
        for name, value in self._request.headers:
            if name == b"content-length":
                return int(value)  # h11 checked it is a number
        return None

    def websocket_stream(self) -> ReplayStream:
        """The stream for trio-websocket: the upgrade request's head (as
        received) and whatever followed it, replayed in front of the socket."""
        assert self._request is not None
        request = self._request
        lines = [request.method + b" " + request.target + b" HTTP/" + request.http_version]
        lines += [name + b": " + value for name, value in request.headers.raw_items()]
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        return ReplayStream(self.stream, head + self._h11.trailing_data[0])

    async def send_json(
        self,
        status: int,
        body: object,
        headers: Sequence[tuple[str, str]] = (),
        *,
        head_only: bool = False,
        close: bool = False,
    ) -> None:
        """A whole JSON response (``body`` as ``encode_json`` writes it).
        If cancelled, part of it may have been sent."""
        payload = encode_json(body) + b"\n"
        await self.send_body(status, payload, "application/json", headers, head_only=head_only, close=close)

    async def send_body(
        self,
        status: int,
        payload: bytes,
        content_type: str,
        headers: Sequence[tuple[str, str]] = (),
        *,
        head_only: bool = False,
        close: bool = False,
    ) -> None:
        """A whole response. If cancelled, part of it may have been sent."""
        extra = [(b"Content-Length", str(len(payload)).encode())]
        if close:
            extra.append((b"Connection", b"close"))
        await self._send(self._response(status, content_type, headers, extra))
        if not head_only and payload:
            await self._send(h11.Data(data=payload))
        await self._send(h11.EndOfMessage())

    async def start_stream(self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Send the head of a streamed response. If cancelled, part of it may have been sent."""
        await self._send(self._response(status, content_type, headers, [(b"Cache-Control", b"no-cache")]))

    async def send_data(self, data: bytes) -> None:
        """Send a piece of a streamed response. If cancelled, part of it may have been sent."""
        await self._send(h11.Data(data=data))

    async def end_stream(self) -> None:
        await self._send(h11.EndOfMessage())

    def _response(self, status: int, content_type: str, headers: Any, extra: list[tuple[bytes, bytes]]) -> h11.Response:
        all_headers = [SERVER_HEADER, (b"Content-Type", content_type.encode())]
        all_headers += [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in [*headers, *self.response_headers]
        ]
        if self._closing() and (b"Connection", b"close") not in extra:
            extra = [*extra, (b"Connection", b"close")]  # said, so that a client does not send another request
        self.status = status
        return h11.Response(status_code=status, headers=all_headers + extra, reason=_reason(status))

    async def send_error_and_close(self, error: BadRequest) -> None:
        """Answer a request that could not be read; the connection is to be
        closed after it. Where h11 will not frame a response (the request
        head itself was malformed), it is written by hand."""
        body = error.body()
        if self._h11.our_state is h11.SEND_RESPONSE:
            try:
                await self.send_json(error.status, body, close=True)
                await self._linger()
                return
            except RuntimeError:
                pass
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE, h11.ERROR):
            with trio.fail_after(self.send_timeout_s):  # bounded like every write (the answer is small)
                await self.stream.send_all(response(error.status, body))
            await self._linger()

    async def _linger(self) -> None:
        """After an error answer: half-close, then read and drop what the
        client still sends (the rest of a body too large, say), at most
        ``LINGER_BYTES`` for ``LINGER_S``. Closing with unread data would
        reset the connection, and the reset would discard the answer before
        the client read it."""
        drained = 0
        with trio.move_on_after(LINGER_S):
            try:
                if isinstance(self.stream, trio.abc.HalfCloseableStream):
                    await self.stream.send_eof()
                while drained < LINGER_BYTES and (data := await self.stream.receive_some(RECEIVE_BYTES)):
                    drained += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def watch_disconnect(self, on_disconnect: trio.CancelScope) -> None:
        """While a request is served: read what the client sends next (h11
        buffers it for the next request, up to ``MAX_PIPELINED_BYTES``) and
        cancel ``on_disconnect`` when it closes the connection or it breaks.
        Cancel this when the response is complete."""
        try:
            while len(self._h11.trailing_data[0]) < MAX_PIPELINED_BYTES:
                data = await self.stream.receive_some(RECEIVE_BYTES)
                if not data:  # a half-close: it still reads (if it is gone, a write will say)
                    self._h11.receive_data(b"")  # no request after this one: the connection closes
                    await trio.sleep_forever()
                self._h11.receive_data(bytes(data))
            await trio.sleep_forever()  # a client that floods us is served, then dropped
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except h11.RemoteProtocolError:  # pragma: no cover - h11 only buffers here
            pass
        on_disconnect.cancel()

    async def _next_event(self) -> Any:
        try:
            while True:
                event = self._h11.next_event()
                if event is not h11.NEED_DATA:
                    return event
                if len(self._h11.trailing_data[0]) > MAX_HEAD_BYTES + self.max_body_bytes:
                    raise BadRequest("request too large", status=413)  # pragma: no cover - h11 bounds heads
                self._h11.receive_data(bytes(await self.stream.receive_some(RECEIVE_BYTES)))
        except h11.RemoteProtocolError as exc:
            raise BadRequest(f"malformed request: {exc}", exc.error_status_hint) from None

    async def _send(self, event: Any) -> None:
        try:
            data = memoryview(self._h11.send(event) or b"")
        except h11.LocalProtocolError as exc:  # pragma: no cover - a bug of ours
            raise RuntimeError(f"HTTP framing error: {exc}") from exc
        for start in range(0, len(data), SEND_PIECE_BYTES):
            with trio.fail_after(self.send_timeout_s):
                await self.stream.send_all(data[start : start + SEND_PIECE_BYTES])


def _check_head(request: h11.Request) -> None:
    """``BadRequest`` for a head over the bounds (h11 bounds only one that
    arrives in several reads) or one framed by two headers at once."""
    headers = request.headers.raw_items()
    if len(headers) > MAX_HEADERS:
        raise BadRequest(f"request head with more than {MAX_HEADERS} header fields", status=431)
    size = len(request.method) + len(request.target) + 12 + sum(len(n) + len(v) + 4 for n, v in headers)
    if size > MAX_HEAD_BYTES:
        raise BadRequest(f"request head larger than {MAX_HEAD_BYTES} bytes", status=431)
    names = {name.lower() for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise BadRequest("a request may not have both Content-Length and Transfer-Encoding")


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
