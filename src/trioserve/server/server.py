"""``trioserve serve``: an engine behind one port: the OpenAI-compatible
HTTP API and ``/metrics`` (``http_api.py``), WebSocket streaming
(``connection.py``) and ``GET /health``.

Task tree::

    Server.run                      nursery; cancelling it drops everything
    ├── accept loop (per listener)  listener.accept_loop: admits each connection (admission.py)
    ├── handler (per connection)    HTTP/1.1 requests through h11 (http_conn.py), kept alive between them:
    │                               /health | rejection | API request (http_api.py) | WebSocket
    │                               Connection.run; over the cap: /health or 503, within OVER_CAP_TIMEOUT_S
    └── engine block                open_engine; leaves only after every WebSocket and API request ended
        ├── engine watch            the engine failing for good (out of restarts) stops the server
        └── grace timer             ends the shutdown grace at its deadline

The listener starts before the engine, so ``/health`` answers 503 while the
model loads. At most ``max_connections`` TCP connections are served at once;
beyond that, a small reserve answers ``/health`` as usual and anything else
with 503 (``admission.py``). A connection must finish its first HTTP head
(and a WebSocket its handshake) within ``handshake_timeout_s`` of being
accepted, each later head within ``keepalive_timeout_s`` of the previous
response, each body within ``handshake_timeout_s`` of its head; it serves
at most ``max_http_requests_per_connection`` requests. A WebSocket idle for
``idle_timeout_s`` is closed with 4408 (``connection.py``). API requests
in flight are tracked with the WebSockets: a shutdown gives them the grace,
then cancels them (their requests are aborted in the engine).

Graceful shutdown (``Server.shutdown``): health turns 503, new WebSockets
are refused (503) and new requests get ``error`` ``shutdown``;
requests in flight have ``shutdown_grace_s`` to finish, then end with
``error`` ``shutdown``; each connection is flushed and closed with 1001 (at
most ``close_timeout_s`` more); then the engine stops and its processes are
reaped. If the engine core dies, its requests in flight end with
``engine_dead`` and the engine restarts (``/health`` says ``restarting``,
503) while the server carries on. If it is out of restarts, the shutdown
happens at once with ``engine_dead`` and close code 1011, and ``run`` raises
``EngineDeadError``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

import trio
from trio_websocket import wrap_server_stream

from trioserve.api import Engine, open_attached_engine, open_engine
from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, collapse
from trioserve.server import http
from trioserve.server.admission import OVER_CAP_TIMEOUT_S, Admission, Slot
from trioserve.server.config import ServerConfig
from trioserve.server.connection import Connection
from trioserve.server.http_api import HttpApi, new_client_id
from trioserve.server.http_conn import HttpConnection
from trioserve.server.listener import accept_loop, fd_limit, fds_needed
from trioserve.server.metrics import ServerMetrics
from trioserve.server.state import ServerState, wait_any
from trioserve.server.stats_log import log_stats
from trioserve.server.tls import server_context

log = logging.getLogger("trioserve.server")
access_log = logging.getLogger("trioserve.access")
INCOMING_MESSAGE_QUEUE = 4  # client messages trio-websocket buffers before we read them
DROP_WRITE_TIMEOUT_S = 0.1  # to write the 503 to a connection dropped for a full reserve


def model_name(config: EngineConfig) -> str:
    """The name the API serves a model under, by default: its directory's name."""
    return Path(config.model).name or config.model


def log_access(head: http.RequestHead, status: int | None, seconds: float, fields: dict[str, object]) -> None:
    """The access-log line of one HTTP request: method, path, status (``-``
    when none was sent: the client went away first), duration, and the
    request's own ``fields`` (request id, prompt and generated tokens)."""
    extra = "".join(f" {name}={value}" for name, value in fields.items())
    access_log.info(
        '"%s %s" %s %.3fs%s',
        head.method,
        head.path[:200],
        "-" if status is None else status,
        seconds,
        extra,
        extra={
            "fields": {
                "method": head.method,
                "path": head.path[:200],
                "status": status,
                "duration_s": round(seconds, 6),
                **fields,
            }
        },
    )


def _only(exc: BaseException, *kinds: type[BaseException]) -> bool:
    """True when ``exc`` is one of ``kinds``, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(inner, *kinds) for inner in exc.exceptions)
    return isinstance(exc, kinds)


class Server:
    """Serve ``engine_config``'s model over WebSocket. Run with ``await
    nursery.start(server.run)`` (started once listening; ``await
    server.wait_ready()`` for the engine) and stop with ``server.shutdown()``."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServerConfig | None = None,
        *,
        listen_socket: socket.socket | None = None,
        attach: tuple[int, str] | None = None,
    ) -> None:
        """``listen_socket``: accept on this listening socket (handed down
        by the supervising process) instead of binding ``config.host:port``.
        ``attach``: this is API server ``attach[0]`` of several; the engine
        cores are the supervising process's, listening in ``attach[1]``."""
        self.engine_config = engine_config
        self._listen_socket = listen_socket
        self._attach = attach
        self.config = config if config is not None else ServerConfig()
        self.state = ServerState()
        self.admission = Admission(self.config.max_connections)  # connections open, by kind of slot
        self.port: int | None = None
        self._startup_scope = trio.CancelScope()
        self._websockets: set[trio.CancelScope] = set()
        self._no_websockets = trio.Event()
        self._no_websockets.set()
        self._engine_failure: EngineDeadError | None = None
        name = self.config.model_name or model_name(engine_config)
        # With several API servers, the first reports the engine cores' own counters (server/metrics.py).
        self.metrics = ServerMetrics(
            engine_config.data_parallel_size, name, reports_engine=attach is None or attach[0] == 0
        )
        self.api = HttpApi(self.state, self.config, self.metrics, name)
        tls = self.config
        self._tls = (
            None
            if tls.ssl_certfile is None
            else server_context(
                tls.ssl_certfile, tls.ssl_keyfile, ca_certs=tls.ssl_ca_certs, cert_reqs=tls.ssl_cert_reqs
            )
        )  # every connection is wrapped in it (server/tls.py)

    @property
    def engine(self) -> Engine | None:
        return self.state.engine

    @property
    def num_connections(self) -> int:
        """TCP connections served now (at most ``config.max_connections``)."""
        return self.admission.num_served

    @property
    def url(self) -> str:
        return f"{'wss' if self._tls else 'ws'}://{self._host_for_url()}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self._http_scheme}://{self._host_for_url()}:{self.port}{http.HEALTH_PATH}"

    @property
    def _http_scheme(self) -> str:
        return "https" if self._tls else "http"

    def _host_for_url(self) -> str:
        host = self.config.host
        return f"[{host}]" if ":" in host else host

    async def wait_ready(self) -> bool:
        """Wait until the engine is ready (True) or the server stopped first
        (False). If cancelled, nothing is left behind."""
        await wait_any(self.state.ready, self.state.stopping)
        return self.state.ready.is_set()

    def shutdown(self) -> None:
        """Begin a graceful shutdown (see the module docstring). A second call
        ends the grace at once. During start-up, the engine start is cancelled."""
        if not self.state.ready.is_set():
            self._startup_scope.cancel()
        self.state.begin_shutdown(self.config.shutdown_grace_s)

    async def run(self, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, start the engine, and serve until ``shutdown()`` has run its
        course; ``task_status.started(self)`` once listening.

        Raises ``EngineStartupError`` if the engine cannot start, and
        ``EngineDeadError`` (after every client got its terminal messages) if
        it dies. If cancelled, every connection is dropped, every request
        aborted, and every engine process stopped and reaped.
        """
        self._check_fd_limit()
        if self._listen_socket is not None:
            listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(self._listen_socket))]
        else:
            listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = listeners[0].socket.getsockname()[1]
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept, listener, nursery)
                task_status.started(self)
                try:
                    await self._run_engine()
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise collapse(group) from None
        if self.state.phase == "dead":
            raise self._engine_failure or EngineDeadError("the engine died; the server stopped")

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections on ``listener``. On a socket shared with other
        API servers, only once the engine is ready: until then the others
        take every connection (one that is restarting never answers 503 to a
        client they could serve)."""
        if self._listen_socket is not None and not await self.wait_ready():
            return
        await accept_loop(listener, self._admit_to(nursery), self._num_open)

    async def _run_engine(self) -> None:
        """Start the engine, serve until the stop, then wait for every
        WebSocket to end (cancelling stragglers) before stopping the engine.
        If cancelled, the engine's processes are stopped and reaped."""
        with self._startup_scope:
            opening = (
                open_engine(config=self.engine_config)
                if self._attach is None
                else open_attached_engine(self.engine_config, *self._attach)
            )
            async with opening as engine:
                engine.add_request_observer(self.metrics.observe)
                self.state.set_ready(engine)
                if not self.state.stopping.is_set():
                    log.info("serving on %s", self.url)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_engine, engine)
                    nursery.start_soon(self.state.run_grace_timer)
                    if self.metrics.multiproc_dir and self.metrics.reports_engine:
                        nursery.start_soon(self.metrics.keep_fresh, engine)
                    if self.config.log_stats_interval_s is not None:
                        nursery.start_soon(log_stats, engine, self.metrics, self.config.log_stats_interval_s)
                    await self.state.stopping.wait()
                    await self._end_websockets()
                    nursery.cancel_scope.cancel()

    async def _end_websockets(self) -> None:
        """Wait for the connections to drain on their own (they end within the
        grace plus ``close_timeout_s``), then cancel any that are left. If
        cancelled, the connections are left to the enclosing cancellation."""
        await wait_any(self._no_websockets, self.state.grace_over)
        with trio.move_on_after(self.config.close_timeout_s + 0.25):
            await self._no_websockets.wait()
        for scope in self._websockets:
            scope.cancel()
        await self._no_websockets.wait()

    async def _watch_engine(self, engine: Engine) -> None:
        """Wait until the engine has failed for good (out of restarts), then
        stop the server. Cancelling leaves nothing behind."""
        error = await engine.wait_failed()
        log.error("the engine failed for good (%s); stopping the server", error)
        self._engine_failure = error
        self.state.engine_died()

    def _engine_healths(self) -> list[str]:
        """Each engine core's health while the server serves (several with data parallelism)."""
        engine = self.state.engine
        return list(engine.engine_healths) if self.state.phase == "ready" and engine is not None else []

    def _health(self) -> str:
        """What ``/health`` reports: the server's phase, or while it serves, the engine's health."""
        engine = self.state.engine
        if self.state.phase == "ready" and engine is not None:
            return engine.health
        return self.state.phase

    def _check_fd_limit(self) -> None:
        """Warn when the open-files limit is too low for ``max_connections`` (the CLI raises it first)."""
        limit, needed = fd_limit(), fds_needed(self.config.max_connections)
        if limit is not None and limit < needed:
            log.warning(
                "the open-files limit (RLIMIT_NOFILE) is %d, below the ~%d that max_connections=%d needs: "
                "accept will fail (EMFILE) before the cap is reached; raise 'ulimit -n' or lower --max-connections",
                limit,
                needed,
                self.config.max_connections,
            )

    # --- one TCP connection ---------------------------------------------------

    def _num_open(self) -> int:
        return self.admission.num_open

    def _admit_to(self, nursery: trio.Nursery) -> Callable[[trio.SocketStream], None]:
        def admit(stream: trio.SocketStream) -> None:
            nursery.start_soon(self._handle_tcp, stream, self.admission.admit())

        return admit

    async def _handle_tcp(self, stream: trio.SocketStream, slot: Slot) -> None:
        """Serve one TCP connection in its ``slot``: ``/health``, an HTTP
        rejection, or a WebSocket; over the cap, ``/health`` or 503. If
        cancelled, the connection is closed at once, its requests are aborted
        in the engine, and its slot is given back."""
        conn: trio.abc.Stream = stream
        try:
            if slot is Slot.SERVE and self.config.socket_send_buffer_bytes is not None:
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_send_buffer_bytes)
            if self._tls is not None:
                if slot is Slot.DROP:
                    return  # no 503 without a handshake: closed at once
                deadline = self.config.handshake_timeout_s if slot is Slot.SERVE else OVER_CAP_TIMEOUT_S
                conn = trio.SSLStream(stream, self._tls, server_side=True, https_compatible=True)
                with trio.move_on_after(deadline) as handshake:
                    await conn.do_handshake()
                if handshake.cancelled_caught:
                    log.debug("a client did not finish the TLS handshake in time: its connection was closed")
                    return
            if slot is Slot.SERVE:
                await self._serve_tcp(conn)
            elif slot is Slot.OVER_CAP:
                await self._answer_over_cap(conn, trio.current_time() + OVER_CAP_TIMEOUT_S)
            else:
                with trio.move_on_after(DROP_WRITE_TIMEOUT_S):
                    reply = http.at_capacity(self.config.max_connections)
                    await stream.send_all(http.response(reply.status, reply.body, extra_headers=reply.headers))
        except Exception as exc:  # from the connection's tasks too: in a group
            if _only(exc, trio.BrokenResourceError, trio.ClosedResourceError):
                log.debug("a client went away, or failed the TLS handshake: its connection was closed")
            elif _only(exc, trio.TooSlowError):
                log.debug(
                    "a client read nothing for %gs: its connection was closed", self.config.slow_consumer_timeout_s
                )
            else:  # a bug serving one client must not stop the others
                log.exception("a connection failed")
        finally:
            self.admission.release(slot)
            await trio.aclose_forcefully(conn)

    async def _serve_tcp(self, stream: trio.abc.Stream) -> None:
        """Serve HTTP requests on one connection, keeping it alive between
        them, until it closes, a WebSocket takes it over, or a bound is
        reached: the first request head must arrive within
        ``handshake_timeout_s`` of the accept (and a WebSocket's handshake
        end by then), each later one within ``keepalive_timeout_s`` of the
        previous response, each body within ``handshake_timeout_s`` of its
        head, and at most ``max_http_requests_per_connection`` requests. If
        cancelled, the connection's requests are aborted in the engine."""
        conn = HttpConnection(
            stream,
            max_body_bytes=self.config.max_message_bytes,
            send_timeout_s=self.config.slow_consumer_timeout_s,
            closing=lambda: (
                conn.num_requests >= self.config.max_http_requests_per_connection or self.state.stopping.is_set()
            ),
        )
        client_id = new_client_id()
        deadline = trio.current_time() + self.config.handshake_timeout_s
        while conn.num_requests < self.config.max_http_requests_per_connection:
            head: http.RequestHead | None = None
            websocket: http.ReplayStream | None = None
            try:
                with trio.move_on_at(deadline):
                    head = await conn.read_head()
                    if head is not None:
                        head = http.without_root(head, self.config.root_path)
                    if head is not None and not head.is_api:
                        reply = http.route(
                            head,
                            phase=self.state.phase,
                            api_key=self.config.api_key,
                            health=self._health(),
                            engines=self._engine_healths(),
                        )
                        if reply is None:
                            websocket = conn.websocket_stream()
                        else:
                            await conn.send_json(
                                reply.status, reply.body, reply.headers, head_only=head.method == "HEAD"
                            )
                if websocket is not None:  # outside the head's deadline: the WebSocket lives on its own bounds
                    return await self._serve_websocket(websocket, deadline)
                if head is None and conn.has_partial_head:  # began a request and did not finish it in time
                    raise http.BadRequest("the request head did not arrive in time", status=408)
                if head is None:
                    return  # closed, or timed out between requests
                if head.is_api:
                    await self._serve_api(conn, head, client_id)
            except http.BadRequest as exc:
                await conn.send_error_and_close(exc)
                return
            with trio.move_on_after(self.config.handshake_timeout_s):
                await conn.finish_request()  # what is left of a body nobody read
            if not conn.can_keep_alive or self.state.stopping.is_set():
                return
            deadline = trio.current_time() + self.config.keepalive_timeout_s

    async def _serve_api(self, conn: HttpConnection, head: http.RequestHead, client_id: str) -> None:
        """Answer one API request; its body must arrive within
        ``handshake_timeout_s``. A shutdown lets it run for the grace, then
        cancels it. If cancelled, its request is aborted in the engine."""
        body_deadline = trio.current_time() + self.config.handshake_timeout_s
        started = time.monotonic()
        with trio.CancelScope() as scope:
            self._track(scope)
            try:
                await self.api.handle(conn, head, client_id, body_deadline)
            finally:
                self._untrack(scope)
                if self.config.log_requests:
                    log_access(head, conn.status, time.monotonic() - started, conn.log_fields)

    async def _answer_over_cap(self, stream: trio.abc.Stream, deadline: float) -> None:
        """Over the connection cap: read one request head by ``deadline``
        (else drop it) and answer ``/health`` as usual, anything else 503;
        then close. If cancelled, the connection is to be closed."""
        conn = HttpConnection(stream, max_body_bytes=0)
        with trio.move_on_at(deadline):
            try:
                head = await conn.read_head()
            except http.BadRequest as exc:
                await conn.send_error_and_close(exc)
                return
            if head is not None:
                reply = http.route_over_capacity(
                    head,
                    health=self._health(),
                    max_connections=self.config.max_connections,
                    engines=self._engine_healths(),
                )
                await conn.send_json(
                    reply.status, reply.body, reply.headers, head_only=head.method == "HEAD", close=True
                )

    @property
    def http_url(self) -> str:
        """The base URL of the OpenAI-compatible API (``.../v1``)."""
        return f"{self._http_scheme}://{self._host_for_url()}:{self.port}/v1"

    async def _serve_websocket(self, stream: http.ReplayStream, handshake_deadline: float) -> None:
        """Finish the WebSocket handshake (by ``handshake_deadline``, else drop
        it) and serve the connection. If cancelled, its requests are aborted
        in the engine."""
        engine = self.state.engine
        assert engine is not None  # route() lets WebSockets through only when ready
        with trio.CancelScope() as scope:
            self._track(scope)
            try:
                async with trio.open_nursery() as nursery:  # trio-websocket's reader task
                    with trio.move_on_at(handshake_deadline) as handshake:
                        ws_request = await wrap_server_stream(
                            nursery,
                            stream,
                            message_queue_size=INCOMING_MESSAGE_QUEUE,
                            max_message_size=self.config.max_message_bytes,
                        )
                        ws = await ws_request.accept()
                    if not handshake.cancelled_caught:
                        await Connection(ws, engine, self.state, self.config).run()
                    nursery.cancel_scope.cancel()
            finally:
                self._untrack(scope)

    def _track(self, scope: trio.CancelScope) -> None:
        if not self._websockets:  # a new event only when the last one was set: someone may be waiting on it
            self._no_websockets = trio.Event()
        self._websockets.add(scope)

    def _untrack(self, scope: trio.CancelScope) -> None:
        self._websockets.discard(scope)
        if not self._websockets:
            self._no_websockets.set()
