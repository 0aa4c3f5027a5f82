"""``trioserve serve --api-server-count M`` (M > 1): a small supervising
process, M API-server processes on one port, the engine cores.

Task tree of the supervising process (its own ``trio.run``)::

    serve_api_servers
    ├── EngineGroup.run              the engine cores, supervised and restarted as with one API
    │                                server (those on other hosts join, as with one); each also
    │                                listens for the API servers (nurseries/engine_core/api_servers.py): a local
    │                                one on ipc:// in a private directory, a remote one on TCP;
    │                                each one's addresses are written in that directory
    └── keep_api_server × M          API server k: a child process, restarted when it dies
        └── api-server process       Server over the shared listening socket, attached to every
                                     engine core, local or remote (frontend/engines/attached.py);
                                     watches its parent

The port. The supervising process binds and listens once, and hands the
listening socket down (``pass_fds``) to every API server, which accepts on
it: the kernel gives each new connection to one of the processes waiting in
``accept``. Rather than ``SO_REUSEPORT`` (one socket per process, the kernel
hashing connections across them), because: the port is the supervisor's for
its whole life, so no other process of the user can bind it beside us and
take a share of the connections, and port 0 works (the port is known before
any API server starts); connections waiting in the one queue when an API
server dies are accepted by the others, where with ``SO_REUSEPORT`` those in
the dead one's own queue are reset; and a restarted API server takes the same
socket, with no window in which the port is closed. The cost: an idle
process may be woken with nothing to accept (trio's accept simply waits
again), and the spread across processes is whoever accepts first, not a hash.

Each API server is a supervised child: one that dies, or falls silent, is
restarted after
``restart_backoff_s`` (doubling), at most ``max_restarts`` times within
``restart_window_s`` (the engines' budget), past which ``serve`` stops
(exit 1). From the moment its event loop runs, it writes a byte on its
ready pipe every ``heartbeat_interval_s`` (``r`` once it serves, ``h``
otherwise), waiting for the engines or serving alike. Every wait has a
deadline: one that shows no sign of life within ``startup_timeout_s`` of
its start (the interpreter and its imports), or is then silent for
``heartbeat_timeout_s`` (stopped, or its loop wedged: it serves nobody),
is killed as hung, which counts as a death. So one stopped before it first
serves is replaced as one stopped later is, and ``serve`` reports that it
serves once a replacement does. Its clients see their connections
close, and its requests are aborted in the engine cores
(``EngineGroup.api_server_died``); the other API servers' see nothing.
Whichever life of an API server first serves reports its start. SIGTERM or SIGINT to the supervising process drains them
(``drain``: each shuts down gracefully, as a single server does, and its
exit is an expected one: ``ChildProcess.expect_exit``), then stops the
engine cores (before they serve, it stops everything at once). ``kill -9``
of the supervising process: the API servers and engine cores see their
parent-watch pipes end and go, with the workers, within about a second;
the first of them to go removes the private directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
from collections import deque
from collections.abc import Callable

import msgspec
import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, TrioserveError
from trioserve.frontend.engines.attached import api_server_addresses
from trioserve.frontend.engines.group import EngineGroup
from trioserve.nurseries.supervision.child_main import remove_if_parent_dies
from trioserve.nurseries.supervision.process import ChildProcess, ProcessExited, python_argv, supervise_process
from trioserve.server.config import ServerConfig
from trioserve.server.metrics import MULTIPROC_DIR_ENV
from trioserve.server.server import Server
from trioserve.transport.silence import Silence
from trioserve.transport.zmq_trio import private_ipc_dir

API_SERVER_ENV = "TRIOSERVE_API_SERVER"  # ApiServerInit, msgpack, hex: holds no secret
API_KEY_FD_ENV = "TRIOSERVE_API_KEY_FD"  # a pipe that carries the API key (never the environment)
LISTEN_FD_ENV = "TRIOSERVE_LISTEN_FD"
READY_FD_ENV = "TRIOSERVE_READY_FD"  # the API server's heartbeats: b"h" while it starts, b"r" once it serves
DRAIN_SIGNAL = signal.SIGUSR1  # to an API server: shut down gracefully (again: end the grace now)
BACKLOG = 4096
METRICS_DIR = "metrics"  # in the private directory: every API server's metrics files
MAX_API_SERVERS = 64  # processes: each holds a tokenizer and its connections
log = logging.getLogger("trioserve.api_servers")


class ApiServerFailed(TrioserveError):
    """An API server died more often than the restart budget allows."""


class ApiServerInit(msgspec.Struct, frozen=True):
    """What an API-server process is told in its environment (readable in
    ``/proc/PID/environ`` by the same user for the process's whole life): so
    ``server_config`` has no API key here; the key comes over a pipe of its
    own (``API_KEY_FD_ENV``)."""

    engine_config: EngineConfig
    server_config: ServerConfig
    index: int
    directory: str  # where the engine cores listen for the API servers


def listen(config: ServerConfig) -> socket.socket:
    """The one listening socket, bound to ``config.host:config.port``."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    return socket.create_server((config.host, config.port), family=family, backlog=BACKLOG)


class ApiServers:
    """The supervising process's state: the engine group and the M API servers."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, count: int) -> None:
        if not 2 <= count <= MAX_API_SERVERS:
            raise ValueError(f"api_server_count: the supervising process is for 2 to {MAX_API_SERVERS} API servers")
        if engine_config.data_parallel_lockstep:
            raise ValueError("api_server_count: more than 1 is not supported with data_parallel_lockstep yet")
        self.engine_config = engine_config
        self.server_config = server_config
        self.count = count
        self.children: list[ChildProcess | None] = [None] * count  # each API server's, while it runs
        self.num_restarts = [0] * count
        self.port: int | None = None
        self.group: EngineGroup | None = None
        self.draining = False  # drain() was called: API servers that exit are not restarted
        self._num_running = 0
        self._none_running = trio.Event()

    def drain(self) -> None:
        """Shut every API server down gracefully (``DRAIN_SIGNAL``: its
        server's ``shutdown()``: requests in flight get the grace, each
        connection closes with 1001); a second call ends the grace at once.
        None is restarted after this. Never blocks."""
        self.draining = True
        for child in self.children:
            if child is not None and child.returncode is None:
                child.expect_exit()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, DRAIN_SIGNAL)

    @property
    def pids(self) -> list[int | None]:
        """Each API server's pid, while it runs."""
        return [None if child is None else child.pid for child in self.children]

    async def wait_drained(self) -> None:
        """Wait until no API server runs (after ``drain``)."""
        await self._none_running.wait()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the port, start the engines, then the API servers; report the
        port once every API server serves. Runs until cancelled (then every
        process is stopped and reaped), or raises ``ApiServerFailed``, or the
        engine group's ``EngineDeadError`` once every engine failed for good."""
        last = self.engine_config.data_parallel_size - 1
        sockets = [address.removeprefix("ipc://").rsplit("/", 1)[1] for address in api_server_addresses("", last)]
        with listen(self.server_config) as sock, private_ipc_dir("trioserve-api-", socket_names=sockets) as directory:
            self.port = sock.getsockname()[1]
            os.mkdir(os.path.join(directory, METRICS_DIR), 0o700)  # removed with the directory
            self.group = EngineGroup(self.engine_config, api_servers_dir=str(directory))
            async with trio.open_nursery() as nursery:
                await nursery.start(self.group.run)
                async with trio.open_nursery() as starting:
                    for k in range(self.count):
                        starting.start_soon(nursery.start, self._keep, k, sock.fileno(), str(directory))
                task_status.started(self.port)
                failure = await self.group.wait_failed()
                await self._drain_after_failure()
                raise failure

    async def _drain_after_failure(self) -> None:
        """Every engine failed for good. Each API server hears so itself
        (the failure is written where it attaches) and ends its requests
        with ``engine_dead``, those waiting to be resumed on an engine too:
        they are drained, within their grace, before everything stops."""
        self.drain()
        with trio.move_on_after(self.server_config.shutdown_grace_s + self.server_config.close_timeout_s + 5):
            await self.wait_drained()

    async def _keep(self, k: int, fd: int, directory: str, *, task_status: trio.TaskStatus[None]) -> None:
        """API server ``k``, restarted within the budget; ``task_status`` once it first serves."""
        init = ApiServerInit(self.engine_config, dataclasses.replace(self.server_config, api_key=None), k, directory)
        env = {**os.environ, API_SERVER_ENV: msgspec.msgpack.encode(init).hex(), LISTEN_FD_ENV: str(fd)}
        env[MULTIPROC_DIR_ENV] = os.path.join(directory, METRICS_DIR)  # their metrics, summed (server/metrics.py)
        deaths: deque[float] = deque()
        started = False

        def ready() -> None:  # the first life that serves reports the start, whichever it is
            nonlocal started
            if not started:
                started = True
                task_status.started()

        self._num_running += 1
        try:
            await self._keep_running(k, fd, env, ready, deaths)
        finally:
            self._num_running -= 1
            if self._num_running == 0:
                self._none_running.set()

    async def _keep_running(
        self, k: int, fd: int, env: dict[str, str], ready: Callable[[], None], deaths: deque[float]
    ) -> None:
        while True:
            try:
                await self._run_one(k, fd, env, ready)
            except* ProcessExited as group:  # it died (an exit asked for by drain() raises nothing)
                log.warning("api-server-%d: %s", k, group.exceptions[0])
            except* OSError as group:  # it could not start (fork: EAGAIN, the process table full): a death too
                log.warning("api-server-%d: could not start: %s", k, group.exceptions[0])
            if (child := self.children[k]) is not None and self.group is not None:
                self.group.api_server_died(k, child.pid)  # a drained one's left only if past the grace
            self.children[k] = None
            if self.draining:
                return
            now = trio.current_time()
            deaths.append(now)
            while deaths and deaths[0] < now - self.engine_config.restart_window_s:
                deaths.popleft()
            if len(deaths) > self.engine_config.max_restarts:
                raise ApiServerFailed(
                    f"api-server-{k} died {len(deaths)} times within {self.engine_config.restart_window_s}s "
                    f"(max_restarts={self.engine_config.max_restarts}); stopping"
                )
            backoff = self.engine_config.restart_backoff_s * 2.0 ** (len(deaths) - 1)
            await trio.sleep(min(backoff, self.engine_config.restart_backoff_max_s))
            if self.draining:  # drained during the backoff: none to start
                return
            self.num_restarts[k] += 1

    async def _run_one(self, k: int, fd: int, env: dict[str, str], ready: Callable[[], None]) -> None:
        """One life of API server ``k``: ``ready()`` once it serves; raises
        ``ProcessExited`` (in a group) when it exits."""
        ends: list[int] = []  # closed at the end, those the child holds at once
        try:
            read_end, write_end = _pipe(ends)
            env = {**env, READY_FD_ENV: str(write_end)}
            pass_fds = [fd, write_end]
            key = self.server_config.api_key
            if key is not None:
                key_read_end, key_write_end = _pipe(ends)
                env[API_KEY_FD_ENV] = str(key_read_end)
                pass_fds.append(key_read_end)
            async with trio.open_nursery() as nursery:
                child = await nursery.start(
                    functools.partial(
                        supervise_process,
                        python_argv("trioserve.server.api_servers"),
                        name=f"api-server-{k}",
                        env=env,
                        pass_fds=tuple(pass_fds),
                        grace_s=self.engine_config.shutdown_grace_s,
                    )
                )
                self.children[k] = child
                for end in pass_fds[1:]:  # the child's now
                    ends.remove(end)
                    os.close(end)
                if key is not None:
                    ends.remove(key_write_end)
                    nursery.start_soon(_hand_over, key_write_end, key.encode())
                await self._watch_heartbeats(k, child, read_end, ready)
        finally:
            for end in ends:
                os.close(end)

    async def _watch_heartbeats(self, k: int, child: ChildProcess, read_end: int, ready: Callable[[], None]) -> None:
        """Read API server ``k``'s heartbeats until its pipe ends (it exits),
        calling ``ready()`` at its first ``r``; if none comes within
        ``startup_timeout_s``, or it is then silent for
        ``heartbeat_timeout_s``, kill it as hung."""
        with trio.move_on_after(self.engine_config.startup_timeout_s) as first:
            await trio.lowlevel.wait_readable(read_end)
        if first.cancelled_caught:
            log.warning(
                "api-server-%d (pid %d) showed no sign of life within %ss of its start (startup_timeout_s): "
                "hung (stopped, or stuck), killed",
                k,
                child.pid,
                self.engine_config.startup_timeout_s,
            )
            child.declare_hung()
            return
        silence = Silence()
        timeout = self.engine_config.heartbeat_timeout_s
        async with silence.watched(timeout):
            while True:
                await trio.lowlevel.wait_readable(read_end)
                beats = os.read(read_end, 4096)
                if not beats:
                    return  # it is exiting: its reaper says how
                silence.heard()
                if b"r" in beats:
                    ready()
        log.warning(
            "api-server-%d (pid %d) sent nothing for %.1fs (heartbeat_timeout_s=%ss): hung (stopped, or stuck), killed",
            k,
            child.pid,
            silence.silent_for(),
            timeout,
        )
        child.declare_hung()


def _pipe(ends: list[int]) -> tuple[int, int]:
    """A pipe, its two ends added to ``ends`` (to be closed)."""
    read_end, write_end = os.pipe()
    ends += (read_end, write_end)
    return read_end, write_end


async def _hand_over(fd: int, data: bytes) -> None:
    """Write ``data`` on pipe ``fd`` and close it (the child reads to its
    end); a child that is gone already is not an error."""
    async with trio.lowlevel.FdStream(fd) as stream:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)


async def _heartbeats(fd: int, interval_s: float, serving: trio.Event) -> None:
    """Write a byte on ``fd`` (the ready pipe) every ``interval_s``, from this
    event loop: ``h`` until ``serving`` is set, then ``r`` at once and ``h``
    after it. A full pipe (the supervising process is stopped) or a closed one
    (it is gone: the parent watch ends this process) is not an error (an
    ``r`` not written is written at the next beat)."""
    os.set_blocking(fd, False)
    told = False
    while True:
        beat = b"r" if serving.is_set() and not told else b"h"
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(fd, beat)
            told = told or beat == b"r"
        if told or serving.is_set():
            await trio.sleep(interval_s)
        else:
            with trio.move_on_after(interval_s):
                await serving.wait()


async def _read_to_end(fd: int) -> str:
    """What the supervising process writes on pipe ``fd`` (``_hand_over``), as text; the pipe is closed."""
    chunks = []
    async with trio.lowlevel.FdStream(fd) as pipe:
        while chunk := await pipe.receive_some():
            chunks.append(chunk)
    return b"".join(chunks).decode()


async def api_server_main() -> None:
    """The API-server process: ``Server`` over the inherited listening socket,
    attached to the engine cores (run by ``run_child_main``)."""
    init = msgspec.msgpack.decode(bytes.fromhex(os.environ.pop(API_SERVER_ENV)), type=ApiServerInit)
    if (key_fd := os.environ.pop(API_KEY_FD_ENV, None)) is not None:
        key = await _read_to_end(int(key_fd))
        init = msgspec.structs.replace(init, server_config=dataclasses.replace(init.server_config, api_key=key))
    listen_socket = socket.socket(fileno=int(os.environ.pop(LISTEN_FD_ENV)))
    ready_fd = int(os.environ.pop(READY_FD_ENV))
    remove_if_parent_dies(init.directory)  # the supervising process's: nobody else removes it after a kill -9
    server = Server(
        init.engine_config, init.server_config, listen_socket=listen_socket, attach=(init.index, init.directory)
    )
    with trio.open_signal_receiver(DRAIN_SIGNAL) as drains:  # before anyone can send one
        async with trio.open_nursery() as nursery:

            async def drain_on_signal() -> None:
                async for _ in drains:
                    server.shutdown()

            async def run() -> None:
                # Returns once a shutdown has run its course; raises once every engine failed for good (the
                # supervising process, which drains this one then, says so and exits 4).
                with contextlib.suppress(EngineDeadError):
                    await server.run()
                nursery.cancel_scope.cancel()

            serving = trio.Event()
            nursery.start_soon(drain_on_signal)
            nursery.start_soon(run)
            nursery.start_soon(_heartbeats, ready_fd, init.engine_config.heartbeat_interval_s, serving)
            if await server.wait_ready():
                serving.set()
