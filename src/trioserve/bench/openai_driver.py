"""Drive a running OpenAI-compatible server (``trioserve serve``, ``vllm
serve``) over HTTP: streamed ``/v1/completions``, the same workload as the
other drivers.

Each request is one streamed completion of its prompt's token ids, greedy,
EOS ignored (``ignore_eos``, which vLLM and trioserve take), on a connection
of its own (HTTP/1.1 through h11; TLS for ``https://``), with
``stream_options.continuous_usage_stats`` so that every chunk says how many
tokens the request has made so far: a chunk's tokens are the difference
(a chunk may hold several, or none when a character is still incomplete).
A server that reports usage only in its last chunk (llama.cpp's
``llama-server``, which streams a chunk per token) has each chunk with text
counted as one token, and the last chunk's usage settles the count.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from trioserve.bench.drivers import Send
from trioserve.bench.stats import RequestRecord
from trioserve.bench.workload import BenchRequest

MAX_EVENT_BYTES = 1 << 20  # one server-sent event (a chunk of one completion) is far smaller


class OpenAIServer:
    """Where to send: ``url`` (``http[s]://HOST:PORT``, with or without
    ``/v1``), the model it serves, and its API key."""

    def __init__(self, url: str, model: str, api_key: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url: {url!r:.80} is not an http:// or https:// URL")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.path = parts.path.rstrip("/").removesuffix("/v1") + "/v1/completions"
        self.model = model
        self.api_key = api_key

    def sender(self) -> Send:
        async def send(request: BenchRequest, record: RequestRecord) -> None:
            await self._complete(request, record)

        return send

    async def _complete(self, request: BenchRequest, record: RequestRecord) -> None:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": request.prompt_token_ids,
                "max_tokens": request.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        ).encode()
        headers = [("Host", self.host), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        if self.api_key:
            headers.append(("Authorization", f"Bearer {self.api_key}"))
        record.sent_s = time.perf_counter()
        stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
        if self.tls:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=self.host)
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            await stream.send_all(conn.send(h11.Request(method="POST", target=self.path, headers=headers)) or b"")
            await stream.send_all(conn.send(h11.Data(data=body)) or b"")
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
            await self._read(stream, conn, record)
        record.finished_s = time.perf_counter()

    async def _read(self, stream: trio.abc.Stream, conn: h11.Connection, record: RequestRecord) -> None:
        status, buffer, error_body, made = 0, b"", b"", 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if status != 200:
                    error_body += bytes(event.data)
                    continue
                buffer += bytes(event.data)
                *events, buffer = buffer.split(b"\n\n")
                if len(buffer) > MAX_EVENT_BYTES:
                    raise ValueError("a server-sent event over 1 MiB")
                for raw in events:
                    made = self._event(raw, record, made)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {error_body[:300].decode(errors='replace')}")

    @staticmethod
    def _event(raw: bytes, record: RequestRecord, made: int) -> int:
        """Record one event's tokens; the request's tokens so far."""
        data = raw.removeprefix(b"data: ").strip()
        if not data or data == b"[DONE]":
            return made
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if usage and usage.get("completion_tokens") is not None:
            now = usage["completion_tokens"]
            record.deliver(time.perf_counter(), now - made)
            made = now
        elif any(choice.get("text") for choice in choices):  # no running count: a chunk per token
            record.deliver(time.perf_counter(), 1)
            made += 1
        for choice in choices:
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        return made


def models_url(url: str) -> str:
    """The OpenAI model list of the server at ``url`` (its WebSocket URL, or its HTTP one)."""
    scheme, _, rest = url.partition("://")
    return f"{'https' if scheme in ('wss', 'https') else 'http'}://{rest.split('/', 1)[0]}/v1/models"


def first_model(url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """The first entry of the server's ``GET /v1/models``; ``ValueError`` when it cannot be read."""
    request = urllib.request.Request(models_url(url))
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            entry = json.loads(response.read(1 << 20))["data"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"cannot read the served model at {request.full_url}: {exc}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"cannot read the served model at {request.full_url}: {entry!r:.80} is no model")
    return entry


def served_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The id of the server's first model; ``ValueError`` naming ``--url`` when it cannot be read."""
    try:
        model = first_model(url, api_key, timeout_s).get("id")
    except ValueError as exc:
        raise ValueError(f"--url: {exc}") from None
    if not isinstance(model, str):
        raise ValueError(f"--url: the first model at {models_url(url)} has no id")
    return model
