"""The server in this process (``serving``) on the fake runner, and its
clients, blocking, to be run in threads (``helpers.waiting.in_thread``): the
WebSocket protocol (``open_ws``, ``generate``, ``collect``...) and plain
HTTP requests (``http_get``, ``raw_request``)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio
from websockets.sync.client import ClientConnection, connect

from trioserve import EngineConfig, SamplingParams
from trioserve.server import Server, ServerConfig


@asynccontextmanager
async def serving(engine_config: EngineConfig, **options: Any) -> AsyncIterator[Server]:
    """A ready server on 127.0.0.1 and a free port; dropped (engine reaped) on exit."""
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # a server another test shares
    server = Server(engine_config, ServerConfig(port=0, **options))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        assert await server.wait_ready()
        yield server
        nursery.cancel_scope.cancel()
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in others] == []


def open_ws(url: str, **kwargs: Any) -> ClientConnection:
    """A WebSocket to ``url``; ``kwargs`` are more options of websockets' ``connect``."""
    return connect(url, open_timeout=10, close_timeout=5, legacy=True, **kwargs)


def generate(request_id: str, prompt: str | list[int], **params: Any) -> str:
    """A ``generate`` message: a text prompt, or token ids; ``params`` are its sampling parameters."""
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return json.dumps({"type": "generate", "id": request_id, key: prompt, "params": params})


@dataclass
class Received:
    """What one request has received so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    terminal: dict[str, Any] | None = None
    at: list[float] = field(default_factory=list)  # arrival time of each message


def collect(
    ws: ClientConnection, ids: set[str], timeout: float = 30, received: dict[str, Received] | None = None
) -> tuple[dict[str, Received], list[dict]]:
    """Read until every request in ``ids`` has its terminal message (adding to
    ``received`` when given). Checks that nothing arrives for a request after
    its terminal. Returns the requests and any messages that name none of them."""
    received = received if received is not None else {}
    for request_id in ids:
        received.setdefault(request_id, Received())
    others: list[dict] = []
    while any(received[request_id].terminal is None for request_id in ids):
        msg = json.loads(ws.recv(timeout=timeout))
        if not record(received, msg):
            others.append(msg)
    return received, others


def record(received: dict[str, Received], msg: dict) -> bool:
    """Add ``msg`` to its request in ``received``; False if it names none."""
    r = received.get(msg.get("id"))  # type: ignore[arg-type]
    if r is None:
        return False
    assert r.terminal is None, f"a message after the terminal one: {msg}"
    r.at.append(time.monotonic())
    if msg["type"] == "delta":
        r.text += msg["text"]
        r.token_ids += msg["token_ids"]
    else:
        assert msg["type"] in ("done", "error"), msg
        r.terminal = msg
    return True


def stream_requests(url: str, requests: list[tuple[str, str | list[int], dict]]) -> dict[str, Received]:
    """``requests`` (id, prompt, parameters) sent on one new connection; what each received."""
    with open_ws(url) as ws:
        for request_id, prompt, params in requests:
            ws.send(generate(request_id, prompt, **params))
        received, others = collect(ws, {r[0] for r in requests})
    assert not others, others
    return received


def expect_error(
    ws: ClientConnection, code: str, request_id: str | None, running: dict[str, Received], timeout: float = 10
) -> dict:
    """The next message about anything but the ``running`` requests (whose
    messages are recorded on the way): it must be this error."""
    while True:
        msg = json.loads(ws.recv(timeout=timeout))
        if (msg["type"] == "error" and msg["code"] == "duplicate_id") or not record(running, msg):
            assert msg["type"] == "error" and msg["code"] == code and msg["id"] == request_id, msg
            return msg


async def wait_blocks_free(server: Server, timeout: float = 5) -> None:
    """Wait until ``server``'s engine holds no request and every KV block is free."""
    assert server.engine is not None
    with trio.fail_after(timeout):
        while True:
            stats = await server.engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
                return
            await trio.sleep(0.02)


def http_get(url: str) -> tuple[int, dict]:
    """A GET of a JSON ``url``: its status and body, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def generate_into(results: dict, server: Server, key: Any, prompt: str, params: dict) -> None:
    """The same request without streaming."""
    assert server.engine is not None
    results[key] = await server.engine.generate(prompt, SamplingParams(**params))


def raw_request(
    server: Server,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: dict[str, str] | None = None,
    declared_length: int | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh socket: ``(status, headers, body)``,
    the connection closed by us after the response."""
    length = len(body) if declared_length is None else declared_length
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    header_lines = head.decode("latin-1").split("\r\n")[1:]
    return status, {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}, payload


def post_json(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A POST of ``body`` as JSON to ``path`` (``raw_request``): its status and JSON answer."""
    status, _, answer = raw_request(server, "POST", path, json.dumps(body).encode())
    return status, json.loads(answer)


def terminal_of(received: Received) -> dict:
    """The request's terminal message, which it must have."""
    assert received.terminal is not None
    return received.terminal


def stream_one(url: str) -> str:
    """One short request on a new connection: the type of its terminal message."""
    with open_ws(url) as ws:
        ws.send(generate("one", "one", max_tokens=5))
        return str(terminal_of(collect(ws, {"one"})[0]["one"])["type"])
