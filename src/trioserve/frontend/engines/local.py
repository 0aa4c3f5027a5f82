"""A local engine core: a child process of this one, started, handshaken and supervised by its client.

Each life binds its handshake, input and output sockets in a private
directory of its own (removed when the life ends, whatever ends it), starts
``python -m trioserve.nurseries.supervision.entry engine-core`` with the
launch contract in its environment (``nurseries/engine_core/launch.py``),
leading a process group of its own (its workers join it, so a kill of the
group leaves none behind), and runs the handshake (``handshake.py``).

Its exit is the life's end: before it was ready, a start-up error naming
the stage (and the process that failed, as the engine core reported it or
as it exited); after, a death, named by the engine core's own death report
when that was read in time (``LAST_WORDS_S``), else by its exit. A hang
kills it, with its process group, at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import trio
import zmq

from trioserve.errors import EngineStartupError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.handshake import Handshake
from trioserve.messages import EngineInfo
from trioserve.nurseries.engine_core.launch import EngineCoreLaunch, ipc_directory
from trioserve.nurseries.supervision.process import ChildProcess, ProcessExited, python_argv, supervise_process
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir

LAST_WORDS_S = 0.02  # after an engine core's exit, for its death report (already in the socket) to be read


class LocalProcessStrategy:
    """Start the engine core as a child process (see the module docstring)."""

    frontend_index = -1  # the engine core's own front-end

    def __init__(self) -> None:
        self.process: ChildProcess | None = None
        self._ipc_dir = ""
        self._handshake: Handshake | None = None

    @contextlib.asynccontextmanager
    async def life(self, client: EngineCoreClient) -> AsyncIterator[None]:
        """The private directory, for the whole life; the process's exit told
        as a start-up error (``EngineStartupError``) or a death."""
        self._handshake = Handshake(client, own_process=True)
        try:
            with private_ipc_dir(socket_names=_socket_names(client)) as ipc_dir:
                self._ipc_dir = str(ipc_dir)
                yield
        except* ProcessExited as group:
            exited = group.exceptions[0]
            assert isinstance(exited, ProcessExited)
            if client.info is None:
                raise self._handshake.error(exited) from None
            client.die(str(exited))

    async def start(self, client: EngineCoreClient, nursery: trio.Nursery) -> EngineInfo:
        assert self._handshake is not None, "started outside its life"
        handshake_address, input_address, output_address = (
            f"ipc://{self._ipc_dir}/{name}" for name in _socket_names(client)
        )
        handshake = TrioZmqSocket.bind(zmq.ROUTER, handshake_address, linger=0)
        input_sock = TrioZmqSocket.bind(zmq.PUSH, input_address, linger=0)
        output_sock = TrioZmqSocket.bind(zmq.PULL, output_address, linger=0)
        with handshake:
            launch = EngineCoreLaunch(
                handshake_address=handshake_address,
                engine_index=client.engine_index,
                handshake_timeout_s=client.config.startup_timeout_s,
                api_servers_dir=None if client.frontends is None else ipc_directory(client.frontends.input_address),
            )
            env = launch.env(os.environ)
            try:
                self.process = await nursery.start(self._supervise, client, env, nursery.cancel_scope)
            except OSError as exc:  # no process: fork failed (EAGAIN: the process table is full; ENOMEM)
                raise EngineStartupError(f"could not start {client.name}: {exc}", stage="spawn", process=client.name)
            info = await self._handshake.run(handshake, input_address, output_address)
        client.serve(nursery, input_sock, output_sock)
        return info

    async def _supervise(
        self,
        client: EngineCoreClient,
        env: dict[str, str],
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The engine-core process, leading a process group of its own. Its
        unexpected exit raises ``ProcessExited`` (after a moment in which
        the output socket reads what it sent last: its own death report names
        the cause better than its exit code); once it was killed as hung and
        reaped, the client is done: ``scope`` is cancelled."""
        argv = python_argv("trioserve.nurseries.supervision.entry", "engine-core")
        try:
            await supervise_process(
                argv,
                name=client.name,
                env=env,
                grace_s=client.config.shutdown_grace_s,
                new_process_group=True,
                task_status=task_status,
            )
        except ProcessExited:
            if client.info is not None and client.dead is None:
                await trio.sleep(LAST_WORDS_S)
            raise
        scope.cancel()

    def hung(self, client: EngineCoreClient) -> None:
        """Kill the engine core and its process group (its exit then ends the life)."""
        if self.process is not None:
            self.process.declare_hung()

    def died(self, client: EngineCoreClient) -> None:
        """Nothing more: the process's exit ends the life."""

    def last_words(self, client: EngineCoreClient, sock: TrioZmqSocket) -> None:
        """Nothing: a local engine core is stopped by its process's supervision."""


def _socket_names(client: EngineCoreClient) -> tuple[str, str, str]:
    """The sockets a life binds in its private directory: handshake, input, output."""
    return "handshake", f"input-{client.engine_index}", "output"
