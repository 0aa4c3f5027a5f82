"""An API server's way to an engine core that another process supervises
(``AttachedStrategy``, the strategy of its ``EngineCoreClient``, one per life;
``serve --api-server-count M``: the supervising ``serve`` process starts the
local engine cores and takes the remote ones' joins; each of the M
API-server processes attaches to every one, local or on another host).

Where an engine core listens for the API servers changes with its life: a
local one binds ``ipc://`` addresses in the supervisor's private directory,
one on another host binds TCP ports there (``nurseries/engine_core/api_servers.py``) and
says which in its ``Ready``. So the supervising process writes each ready
engine core's addresses into that directory (``engine-<i>.addr``, a
msgpack ``FrontEndsInit``, replaced atomically by a rename) and removes the
file when the engine core dies; the API servers read it.

A life reads the file (waiting while there is none), connects a PUSH to the
engine core's API-server PULL and a DEALER to its ROUTER (CURVE clients with
the deployment's keys when the addresses are TCP), says ``Attach`` with a
number new to the life (the engine core aborts what earlier lives of this
API server sent: their requests have already failed here) (again
every ``ATTACH_RETRY_S`` until answered, reading the file again each time and
connecting anew when it changed) and, given ``Attached`` (the engine's info and its
paused or asleep state), serves
like any client: its requests carry its index, its call ids are its own
(index << 32 up), the engine core's heartbeats keep it alive. When the engine
core dies (it says ``EngineDead``, its end of the connection closes, or it
is silent for ``heartbeat_timeout_s``: a host that vanished closes nothing),
the requests of this API server fail with ``EngineDeadError`` and the life
ends; the next one attaches to the engine core that takes its place. An
engine that failed for good (out of restarts) gets no next one: the
supervisor writes why in ``engine-<i>.failed``, and a life waiting for
addresses raises ``EngineFailedError`` with it. Nothing here starts, stops
or restarts a process.

Invariants: a life connects only to addresses the supervisor wrote for its
engine index, and takes only an ``Attached`` from an engine core of that
index (``Attach.engine``); the file is never seen half-written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator

import msgspec
import trio
import zmq

from trioserve.config import EngineConfig
from trioserve.errors import EngineFailedError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.messages import Attach, Attached, EngineInfo, EngineResponse, FrontEndsInit
from trioserve.transport.curve import load_keys
from trioserve.transport.zmq_trio import TrioZmqSocket

ATTACH_RETRY_S = 0.5
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(EngineResponse).decode
_decode_addresses = msgspec.msgpack.Decoder(FrontEndsInit).decode


def api_server_addresses(directory: str, engine_index: int) -> tuple[str, str]:
    """Where local engine core ``engine_index`` listens for API servers: (input, output)."""
    return f"ipc://{directory}/engine-{engine_index}-in", f"ipc://{directory}/engine-{engine_index}-out"


def _addresses_file(directory: str, engine_index: int) -> str:
    return os.path.join(directory, f"engine-{engine_index}.addr")


def write_engine_addresses(directory: str, engine_index: int, addresses: FrontEndsInit) -> None:
    """Tell the API servers where engine core ``engine_index`` listens for them
    (written beside, then renamed over the last: a reader sees one or the other)."""
    path = _addresses_file(directory, engine_index)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        f.write(_encode(addresses))
    os.replace(partial, path)


def forget_engine_addresses(directory: str, engine_index: int) -> None:
    """Engine core ``engine_index`` is dead: no API server connects there any more."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_addresses_file(directory, engine_index))


def _failure_file(directory: str, engine_index: int) -> str:
    return os.path.join(directory, f"engine-{engine_index}.failed")


def write_engine_failure(directory: str, engine_index: int, reason: str) -> None:
    """Tell the API servers that engine ``engine_index`` failed for good (it will not be restarted)."""
    path = _failure_file(directory, engine_index)
    with open(f"{path}.partial", "w", encoding="utf-8") as f:
        f.write(reason)
    os.replace(f"{path}.partial", path)


def read_engine_failure(directory: str, engine_index: int) -> str | None:
    """Why engine ``engine_index`` failed for good, or None while it has not."""
    try:
        with open(_failure_file(directory, engine_index), encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def read_engine_addresses(directory: str, engine_index: int) -> FrontEndsInit | None:
    """Where engine core ``engine_index`` listens for the API servers; None
    while it is not ready. (A small file on a local disk, read at most every
    ``ATTACH_RETRY_S``: read in the Trio thread.)"""
    try:
        with open(_addresses_file(directory, engine_index), "rb") as f:
            return _decode_addresses(f.read())
    except (FileNotFoundError, msgspec.DecodeError):
        return None


class AttachedStrategy:
    """Attach API server ``frontend`` to an engine core that the supervising
    process found through ``directory`` (see the module docstring)."""

    def __init__(self, config: EngineConfig, frontend: int, directory: str) -> None:
        self.frontend_index = frontend
        self._directory = directory
        self._life: trio.CancelScope | None = None
        # Options for TCP sockets (an engine core on another host): CURVE clients, unless insecure_tcp.
        keys = None if config.curve_keys_dir is None else load_keys(config.curve_keys_dir)
        self._tcp_options = {} if keys is None else keys.client_options()
        self.addresses: FrontEndsInit | None = None  # where this life attached

    @contextlib.asynccontextmanager
    async def life(self, client: EngineCoreClient) -> AsyncIterator[None]:
        """Nothing held beyond the sockets: no directory, no process."""
        yield

    async def start(self, client: EngineCoreClient, nursery: trio.Nursery) -> EngineInfo:
        self._life = nursery.cancel_scope
        input_sock, output_sock, info = await self._attach(client)
        client.serve(nursery, input_sock, output_sock)
        nursery.start_soon(self._watch_connection, client, output_sock)
        return info

    async def _watch_connection(self, client: EngineCoreClient, sock: TrioZmqSocket) -> None:
        """The engine core is dead the moment its end of the ROUTER
        connection closes (a connection closes when its process dies, even by
        ``kill -9``, while its host lives): sooner than its silence would tell."""
        monitor = TrioZmqSocket(sock.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        try:
            await monitor.recv_multipart()
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.socket.disable_monitor()
            monitor.close()
        client.die("its connection to the API servers closed: the engine core is gone")

    async def _attach(self, client: EngineCoreClient) -> tuple[TrioZmqSocket, TrioZmqSocket, EngineInfo]:
        """Connect where the supervisor says and say ``Attach`` until the
        engine core answers (as long as it takes: the supervisor bounds a
        local engine core's start, and a remote one may be away for long);
        the input and output sockets, and the engine's info. If cancelled,
        nothing is left behind."""
        life = secrets.randbits(62) + 1  # new to this life: the engine core aborts what earlier lives sent
        index = client.engine_index
        attach = _encode(Attach(frontend=self.frontend_index, engine=index, pid=os.getpid(), life=life))
        sockets: tuple[TrioZmqSocket, TrioZmqSocket] | None = None
        try:
            while True:
                addresses = read_engine_addresses(self._directory, index)
                if addresses != self.addresses:
                    _close(sockets)
                    sockets, self.addresses = None, addresses
                    if addresses is not None:
                        sockets = self._connect(addresses)
                if sockets is None:
                    if (reason := read_engine_failure(self._directory, index)) is not None:
                        raise EngineFailedError(reason)  # no next life to wait for
                    await trio.sleep(ATTACH_RETRY_S)
                    continue
                with trio.move_on_after(ATTACH_RETRY_S):
                    await sockets[1].send(attach)
                    while True:
                        msg = _decode(await sockets[1].recv())
                        if isinstance(msg, Attached):
                            client.state = msg.state
                            return (*sockets, msg.info)
        except BaseException:
            _close(sockets)
            raise

    def _connect(self, addresses: FrontEndsInit) -> tuple[TrioZmqSocket, TrioZmqSocket]:
        options = self._tcp_options if addresses.output_address.startswith("tcp://") else {}
        input_sock = TrioZmqSocket.connect(zmq.PUSH, addresses.input_address, linger=0, **options)
        try:
            output_sock = TrioZmqSocket.connect(zmq.DEALER, addresses.output_address, linger=0, **options)
        except BaseException:
            input_sock.close()
            raise
        return input_sock, output_sock

    def hung(self, client: EngineCoreClient) -> None:
        """No process to kill here: the life ends; the supervisor's watch of
        the engine core kills it if it is really hung."""
        if self._life is not None:
            self._life.cancel()

    def died(self, client: EngineCoreClient) -> None:
        """The life ends: the next one attaches to the engine core that takes its place."""
        self.hung(client)

    def last_words(self, client: EngineCoreClient, sock: TrioZmqSocket) -> None:
        """Nothing: the engine core's supervising process stops it."""


def _close(sockets: tuple[TrioZmqSocket, TrioZmqSocket] | None) -> None:
    if sockets is not None:
        for sock in sockets:
            sock.close()
