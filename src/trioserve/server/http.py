"""HTTP requests as the server routes them: plain functions, no I/O.

Every connection speaks HTTP/1.1, parsed by h11 (``http_conn.py`` holds the
connection's async shell): a request head is at most ``MAX_HEAD_BYTES``.
``route`` decides what to answer to ``GET /health`` and to anything that is
neither the OpenAI-compatible API (``/v1/...``) nor ``/metrics``: the
status, or a WebSocket upgrade to hand to trio-websocket, with the request
head replayed in front of the stream (``ReplayStream``). Over the connection
cap, ``route_over_capacity`` answers instead of ``route``.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import msgspec
import trio

from trioserve.server.admission import RETRY_AFTER_S
from trioserve.server.openai_responses import ErrorBody, ErrorObject

MAX_HEAD_BYTES = 16 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    405: "Method Not Allowed",
    426: "Upgrade Required",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
_NOT_READY = {
    "starting": "the engine is starting",
    "stopping": "the server is shutting down",
    "dead": "the engine died",
}


class BadRequest(Exception):
    """The request head is not valid HTTP/1.1; the message says why."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> ErrorBody:
        """The answer's body: OpenAI's error object (what the API's clients read), for any path."""
        codes = {408: "request_timeout", 413: "request_too_large", 431: "request_head_too_large"}
        code = codes.get(self.status, "malformed_request")
        return ErrorBody(ErrorObject(message=str(self), type="invalid_request_error", param=None, code=code))


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "

    @property
    def path(self) -> str:
        target = self.target
        if not target.startswith("/") and "://" in target:
            # The absolute form (``POST http://host/v1/completions``), which a server must take
            # (RFC 9112, 3.2.2), not a path outside the API.
            target = urlsplit(target).path or "/"
        return target.split("?", 1)[0]

    @classmethod
    def from_h11(cls, request: h11.Request) -> RequestHead:
        headers: dict[str, str] = {}
        for name, value in request.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        return cls(method=request.method.decode("latin-1"), target=request.target.decode("latin-1"), headers=headers)

    @property
    def is_api(self) -> bool:
        """A plain HTTP request (``http_api.py``: the OpenAI-compatible API,
        the metrics, the other endpoints, a 404): anything but ``/health``
        and a WebSocket handshake."""
        return self.path != HEALTH_PATH and not self.is_websocket_upgrade

    @property
    def is_websocket_upgrade(self) -> bool:
        return "websocket" in self.headers.get("upgrade", "").lower()

    def has_bearer_token(self, api_key: str) -> bool:
        """True when ``Authorization: Bearer <api_key>`` is present (compared in constant time). Compared
        as bytes: the header's as sent (decoded as latin-1, so encoding it back gives them), the key's as
        UTF-8, so that a key outside ASCII matches the same key sent by a client."""
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode())


def without_root(head: RequestHead, root_path: str) -> RequestHead:
    """``head`` with ``root_path`` (``/api``) taken off the front of its
    path, when it is there: a proxy in front may forward paths with or
    without it."""
    if not root_path or not head.target.startswith(root_path):  # (a target in absolute form is left as it is)
        return head
    if not (head.path == root_path or head.path.startswith(root_path + "/")):
        return head
    rest = head.target[len(root_path) :]
    return dataclasses.replace(head, target=rest if rest.startswith("/") else "/" + rest)


def parse_request_head(head: bytes) -> RequestHead:
    """Parse a complete request head (up to and including the blank line) with h11."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise BadRequest(f"malformed request head: {exc}", exc.error_status_hint) from None
    if not isinstance(event, h11.Request):
        raise BadRequest("incomplete request head")
    return RequestHead.from_h11(event)


@dataclass(frozen=True)
class Reply:
    """An HTTP response to send instead of a WebSocket handshake."""

    status: int
    body: dict[str, object]
    headers: tuple[tuple[str, str], ...] = ()


def route(
    head: RequestHead,
    *,
    phase: str,
    api_key: str | None,
    health: str | None = None,
    engines: Sequence[str] = (),
) -> Reply | None:
    """What to answer to ``head`` (``/health``, or a WebSocket handshake):
    a ``Reply``, or None to go on with the handshake. ``GET /health`` needs
    no API key; it reports ``health`` (default: ``phase``), 200 when that is
    ``ready``, and with several engines each one's health (``engines``, by
    index). Errors are OpenAI's error object."""
    if head.path == HEALTH_PATH:
        return _health_reply(head, health if health is not None else phase, engines)
    if not head.is_websocket_upgrade:  # (plain requests go to http_api.py: this is for direct callers)
        return _error(404, f"no such endpoint: {head.method} {head.path[:100]}", "not_found")
    if "sec-websocket-key" not in head.headers or head.headers.get("sec-websocket-version") != "13":
        return _error(
            400, "bad WebSocket handshake: needs Sec-WebSocket-Key and Sec-WebSocket-Version: 13", "bad_handshake"
        )
    if api_key is not None and not head.has_bearer_token(api_key):
        return _error(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "invalid_api_key",
            (("WWW-Authenticate", 'Bearer realm="trioserve"'),),
            kind="authentication_error",
        )
    if phase != "ready":
        return _error(503, _NOT_READY.get(phase, phase), "unavailable", kind="server_error")
    return None


def _error(
    status: int,
    message: str,
    code: str,
    headers: tuple[tuple[str, str], ...] = (),
    *,
    kind: str = "invalid_request_error",
) -> Reply:
    """A ``Reply`` holding OpenAI's error object."""
    return Reply(status, {"error": {"message": message, "type": kind, "param": None, "code": code}}, headers)


def route_over_capacity(head: RequestHead, *, health: str, max_connections: int, engines: Sequence[str] = ()) -> Reply:
    """What to answer when the connection cap is full: ``/health`` as usual
    (it is cheap, and a full server is not an unhealthy one), anything else
    503 with ``Retry-After``."""
    if head.path == HEALTH_PATH:
        return _health_reply(head, health, engines)
    return at_capacity(max_connections)


def at_capacity(max_connections: int) -> Reply:
    """The 503 for a connection over the cap (``max_connections``)."""
    message = f"too many connections: the server is at its limit of {max_connections}; retry later"
    reply = _error(503, message, "too_many_connections", (("Retry-After", str(RETRY_AFTER_S)),), kind="server_error")
    return Reply(reply.status, {**reply.body, "max_connections": max_connections}, reply.headers)


def _health_reply(head: RequestHead, status: str, engines: Sequence[str] = ()) -> Reply:
    if head.method not in ("GET", "HEAD"):
        return _error(405, "use GET /health", "method_not_allowed", (("Allow", "GET, HEAD"),))
    body: dict[str, object] = {"status": status}
    if len(engines) > 1:
        body["engines"] = [{"engine": i, "status": s} for i, s in enumerate(engines)]
    return Reply(200 if status == "ready" else 503, body)


_json = msgspec.json.Encoder()


def encode_json(body: object) -> bytes:
    """``body`` (a msgspec struct, or builtins) as the JSON every response
    sends: encoded by msgspec, on one line, with a space after each ``,``
    and ``:`` (as Python's ``json.dumps`` writes it); text is UTF-8, not
    ``\\u`` escapes, and a float that is not finite is ``null``."""
    return msgspec.json.format(_json.encode(body), indent=0)


def response(
    status: int, body: object, *, extra_headers: tuple[tuple[str, str], ...] = (), head_only: bool = False
) -> bytes:
    """A complete HTTP/1.1 response with a JSON body (``encode_json``); the connection closes after it."""
    payload = encode_json(body) + b"\n"
    lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    lines += [f"{name}: {value}" for name, value in extra_headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else payload)


class ReplayStream(trio.abc.Stream):
    """A stream that first returns bytes already read from ``inner``, then
    delegates to it."""

    def __init__(self, inner: trio.abc.Stream, replay: bytes) -> None:
        self._inner = inner
        self._replay = replay

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Bytes from the replay buffer, then from the inner stream."""
        if self._replay:
            size = len(self._replay) if max_bytes is None else max_bytes
            data, self._replay = self._replay[:size], self._replay[size:]
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self._inner.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """As the inner stream's: if cancelled, part of ``data`` may have been sent."""
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the inner stream (forcefully, if cancelled)."""
        await self._inner.aclose()
