"""An API server's client of an engine core that another process supervises
(``serve --api-server-count M``: the supervising ``serve`` process starts the
engine cores; each of the M API-server processes attaches to every one).

A life connects a PUSH to the engine core's API-server PULL and a DEALER to
its ROUTER (``nurseries/api_servers.py``), says ``Attach`` (again every
``ATTACH_RETRY_S`` until answered: while the engine core restarts, nothing
listens yet) and, given ``Attached(EngineInfo)``, serves like any client:
its requests carry its index, its call ids are its own (index << 32 up), the
engine core's heartbeats keep it alive. When the engine core dies (it says
``EngineDead``, or it is silent for ``heartbeat_timeout_s``), the requests
of this API server fail with ``EngineDeadError`` and the life ends; the next
one attaches to the engine core the supervisor starts in its place, at the
same addresses. Nothing here starts, stops or restarts a process.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import msgspec
import trio
import zmq

from trioserve.config import EngineConfig
from trioserve.frontend.client import EngineCoreClient
from trioserve.messages import Attach, Attached, EngineInfo, EngineResponse
from trioserve.transport.zmq_trio import TrioZmqSocket

ATTACH_RETRY_S = 0.5
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(EngineResponse).decode


def api_server_addresses(directory: str, engine_index: int) -> tuple[str, str]:
    """Where engine core ``engine_index`` listens for API servers: (input, output)."""
    return f"ipc://{directory}/engine-{engine_index}-in", f"ipc://{directory}/engine-{engine_index}-out"


class AttachedEngineCoreClient(EngineCoreClient):
    """See the module docstring."""

    USES_PRIVATE_DIR = False

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int,
        frontend: int,
        directory: str,
        *,
        on_dead: Callable[[EngineCoreClient], None] | None = None,
    ) -> None:
        super().__init__(config, engine_index, on_dead=on_dead)
        self.frontend_index = frontend
        self._addresses = api_server_addresses(directory, engine_index)
        self._call_ids = itertools.count(frontend << 32)
        self._life: trio.CancelScope | None = None

    async def _start(self, nursery: trio.Nursery, ipc_dir: str) -> EngineInfo:
        self._life = nursery.cancel_scope
        self._stage = "handshake"
        input_address, output_address = self._addresses
        input_sock = TrioZmqSocket.connect(zmq.PUSH, input_address, linger=0)
        output_sock = TrioZmqSocket.connect(zmq.DEALER, output_address, linger=0)
        try:
            info = await self._attach(output_sock)
        except BaseException:
            input_sock.close()
            output_sock.close()
            raise
        self._serve_sockets(nursery, input_sock, output_sock)
        nursery.start_soon(self._watch_connection, output_sock)
        return info

    async def _watch_connection(self, sock: TrioZmqSocket) -> None:
        """The engine core is dead the moment its end of the ROUTER
        connection closes (an ``ipc://`` connection closes when its process
        dies, even by ``kill -9``): sooner than its silence would tell."""
        monitor = TrioZmqSocket(sock.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        try:
            await monitor.recv_multipart()
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.socket.disable_monitor()
            monitor.close()
        self._die("its connection to the API servers closed: the engine core is gone")

    async def _attach(self, sock: TrioZmqSocket) -> EngineInfo:
        """Say ``Attach`` until the engine core answers (as long as it takes:
        the supervisor bounds the engine core's start). If cancelled, nothing
        is left behind."""
        attach = _encode(Attach(frontend=self.frontend_index))
        while True:
            await sock.send(attach)
            with trio.move_on_after(ATTACH_RETRY_S):
                while True:
                    msg = _decode(await sock.recv())
                    if isinstance(msg, Attached):
                        return msg.info

    def _hung(self) -> None:
        """No process to kill here: the life ends; the supervisor's watch of
        the engine core kills it if it is really hung."""
        if self._life is not None:
            self._life.cancel()

    def _die(self, reason: str) -> None:
        super()._die(reason)
        self._hung()  # the next life attaches to the engine core that takes its place
