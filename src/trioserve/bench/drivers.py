"""Drive a workload through an engine: in-process (``open_engine``) or a
running server (the WebSocket API), recording each request's timings.

``drive`` owns the pacing, the same for both: a request is sent at its
arrival time (all at once without a request rate) once fewer than
``concurrency`` are in flight. A driver's ``send(request, record)`` runs one
request to its end, filling in the record. Failed requests are recorded, not
raised: a benchmark reports them.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from trioserve.api import Engine
from trioserve.bench.stats import RequestRecord
from trioserve.bench.workload import BenchRequest, WorkloadSpec
from trioserve.sampling_params import SamplingParams

Send = Callable[[BenchRequest, RequestRecord], Awaitable[None]]
REQUESTS_PER_CONNECTION = 32  # the server allows 64 in flight per connection by default


def bench_params(max_tokens: int) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` tokens: every run does the same work."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Progress:
    """A one-line progress report on stderr (rewritten in place on a terminal,
    a line every 10% otherwise). Not tqdm: on a pipe or a log file tqdm 4.70
    writes every redraw on one line, separated by carriage returns (checked
    with ``miniters`` set to a tenth), where this writes ten lines a log
    reads well."""

    def __init__(self, total: int, *, enabled: bool = True, stream: Any = None) -> None:
        self.total = total
        self.done = 0
        self.tokens = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self._tty = self.stream.isatty()
        self._last_decile = -1

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.tokens += record.num_output_tokens
        if not self.enabled:
            return
        decile = self.done * 10 // self.total
        if not self._tty and decile == self._last_decile:
            return
        self._last_decile = decile
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        width = 30
        bar = "#" * (self.done * width // self.total)
        line = f"[{bar:<{width}}] {self.done}/{self.total} requests, {elapsed:6.1f}s, {rate:7.1f} tok/s"
        end = "\r" if self._tty and self.done < self.total else "\n"
        print(line, end=end, file=self.stream, flush=True)


async def drive(
    requests: list[BenchRequest], spec: WorkloadSpec, send: Send, progress: Progress | None = None
) -> list[RequestRecord]:
    """Run every request through ``send`` with the spec's pacing; the records
    in request order. If cancelled, requests in flight are cancelled too."""
    records = [RequestRecord(r.index, len(r.prompt_token_ids), r.max_tokens) for r in requests]
    limit = trio.CapacityLimiter(spec.concurrency or len(requests))
    start = trio.current_time()

    async def one(request: BenchRequest, record: RequestRecord) -> None:
        try:
            await send(request, record)
        except Exception as exc:  # a failed request is a figure, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            limit.release_on_behalf_of(request.index)
            if math.isnan(record.finished_s):
                record.finished_s = time.perf_counter()
            if progress is not None:
                progress.update(record)

    async with trio.open_nursery() as nursery:
        for request, record in zip(requests, records, strict=True):
            await trio.sleep_until(start + request.arrival_s)
            await limit.acquire_on_behalf_of(request.index)
            nursery.start_soon(one, request, record)
    return records


def engine_sender(engine: Engine) -> Send:
    """Requests through an in-process engine (``Engine.stream``)."""

    async def send(request: BenchRequest, record: RequestRecord) -> None:
        record.sent_s = time.perf_counter()
        async with engine.stream(request.prompt_token_ids, bench_params(request.max_tokens)) as stream:
            async for out in stream:
                record.deliver(time.perf_counter(), len(out.token_ids))
                if out.finished:
                    record.finish_reason = out.finish_reason
        record.finished_s = time.perf_counter()

    return send


class _ServerMessage(msgspec.Struct):
    type: str
    id: str | None = None
    token_ids: list[int] = []
    finish_reason: str | None = None
    code: str | None = None
    message: str | None = None


class WebSocketPool:
    """Connections to a running ``trioserve serve``; each request goes to the
    connection with the fewest in flight. A reader task per connection
    routes the server's messages to the request's record."""

    def __init__(self, url: str, num_connections: int, api_key: str | None = None) -> None:
        self.url = url
        self.num_connections = num_connections
        self.headers = [(b"Authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._conns: list[WebSocketConnection] = []
        self._in_flight: list[int] = []
        self._waiting: dict[str, tuple[RequestRecord, trio.Event]] = {}
        self._ids = itertools.count()
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(_ServerMessage).decode

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the connections and read from them until cancelled (then they close)."""
        async with trio.open_nursery() as nursery:
            for _ in range(self.num_connections):
                conn = await nursery.start(self._connection)
                self._conns.append(conn)
                self._in_flight.append(0)
            task_status.started()

    async def _connection(self, *, task_status: trio.TaskStatus[WebSocketConnection]) -> None:
        async with open_websocket_url(self.url, extra_headers=self.headers) as ws:
            task_status.started(ws)
            while True:
                self._dispatch(self._decode(await ws.get_message()))

    def _dispatch(self, msg: _ServerMessage) -> None:
        waiting = self._waiting.get(msg.id or "")
        if waiting is None:
            return
        record, done = waiting
        now = time.perf_counter()
        if msg.type == "delta":
            record.deliver(now, len(msg.token_ids))
            return
        if msg.type == "done":
            record.finish_reason = msg.finish_reason
        else:
            record.error = f"{msg.code}: {msg.message}"
        record.finished_s = now
        done.set()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        slot = min(range(len(self._conns)), key=self._in_flight.__getitem__)
        request_id = str(next(self._ids))
        done = trio.Event()
        self._waiting[request_id] = (record, done)
        self._in_flight[slot] += 1
        params = msgspec.to_builtins(bench_params(request.max_tokens))
        frame = {"type": "generate", "id": request_id, "prompt_token_ids": request.prompt_token_ids, "params": params}
        try:
            record.sent_s = time.perf_counter()
            await self._conns[slot].send_message(self._encode(frame).decode())
            await done.wait()
        finally:
            self._in_flight[slot] -= 1
            del self._waiting[request_id]


def connections_for(spec: WorkloadSpec) -> int:
    """WebSocket connections enough for the requests in flight at once (never
    more than there are requests, whatever ``concurrency`` says)."""
    in_flight = min(spec.concurrency or spec.num_requests, spec.num_requests)
    return max(1, -(-in_flight // REQUESTS_PER_CONNECTION))
