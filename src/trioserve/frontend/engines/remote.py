"""Engine cores on other hosts (``serve --headless`` there), as the head sees them.

``RemoteEngines`` owns the head's one TCP handshake socket (a ROUTER bound at
``tcp://data_parallel_address:data_parallel_rpc_port``, a CURVE server unless
``insecure_tcp``) that every remote engine core connects to, and the
process's ZAP handler (``transport/curve.py``). A ``Hello`` from engine
index ``i`` is kept as ``i``'s latest; the client of ``i``'s next life takes
it. The handshake messages that follow from the same connection (ZeroMQ
identity) go to the life that took its ``Hello``.

Before it starts an engine core, a headless process asks (``MayJoin``) and
is answered (``JoinAnswer``): no while index ``i`` is not one this head
takes from other hosts, or while ``i``'s life is live (joined, not known
dead) with an engine core other than that process's previous one of index
``i`` (two hosts given the same ``--data-parallel-start-rank``; or a
headless tree restarted before its old engine core was found silent).

``RemoteStrategy`` is the strategy of an ``EngineCoreClient`` whose engine
core is no process of this one (``client.py``), one per life. A
life begins when a ``Hello`` for its index arrives (it waits as long as that
takes), binds its input and output sockets on ``tcp://data_parallel_address:0``
(CURVE too), hands their addresses over in ``HandshakeInit`` (with several
API servers on the head, ``frontends`` also asks the engine core to listen
for them on TCP: ``nurseries/engine_core/api_servers.py``), and then serves like a
local engine core, sending a ``Ping`` every ``heartbeat_interval_s`` (the
engine core's proof that the head lives). When the engine core sends
nothing for ``heartbeat_timeout_s`` (its host died, its tree was killed, the
network broke), its requests fail with ``EngineDeadError`` and the life
ends; the next one waits for the engine core to join again. A ``Hello`` for
an index whose life is live is refused (dropped, and logged) unless the
headless process of the live engine core asked for it, with that engine
core's pid (it restarted its engine core): then the live one is dead at once,
replaced.

Invariants: only the hub's task touches the ROUTER socket (others queue
frames with ``send_nowait``); at most one life holds a given connection's
handshake messages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Literal

import msgspec
import trio
import zmq

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, EngineStartupError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.handshake import Handshake
from trioserve.messages import EngineInfo, HandshakeMessage, Hello, JoinAnswer, MayJoin, Ping
from trioserve.transport.curve import CurveAuthenticator, CurveKeys, load_keys
from trioserve.transport.router import SocketLoop
from trioserve.transport.zmq_trio import TrioZmqSocket

LEAVING_S = 0.5  # how long a stopping head's last words to an engine core may take to go out
LINK_SIZE = 64  # handshake messages (heartbeats while the workers load) waiting for their life
log = logging.getLogger("trioserve.remote")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(HandshakeMessage).decode


def _say_leaving_on(sock: TrioZmqSocket, envelopes: list[list[bytes]]) -> None:
    """Send ``Ping(leaving=True)`` once per envelope (a ROUTER's: the peer's
    identity; else none) without waiting, and let ZeroMQ go on sending for
    ``LEAVING_S`` after ``sock`` closes. Nothing is raised: this runs on the
    way out."""
    leaving = _encode(Ping(leaving=True))
    with contextlib.suppress(zmq.ZMQError):
        sock.socket.setsockopt(zmq.LINGER, int(LEAVING_S * 1000))
        for envelope in envelopes:
            sock.socket.send_multipart([*envelope, leaving], zmq.NOBLOCK)


class RemoteEngines:
    """The head's handshake socket for engine cores on other hosts (see the
    module docstring). Run it (``await nursery.start(hub.run)``) before the
    remote engines' supervisors."""

    def __init__(self, config: EngineConfig, *, keys: CurveKeys | Literal["config"] | None = "config") -> None:
        self.config = config
        # (port 0: the kernel picks one; ``address`` is then the bound one once ``run`` has started)
        self.address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
        if keys == "config":
            keys = None if config.curve_keys_dir is None else load_keys(config.curve_keys_dir)
        self.keys = keys
        self.authenticator = None if self.keys is None else CurveAuthenticator(self.keys)
        self._hellos: dict[int, tuple[int, list[bytes]]] = {}  # engine index -> its latest Hello's pid, frames
        self._links: dict[bytes, trio.MemorySendChannel[list[bytes]]] = {}  # identity -> its life
        self._live: dict[int, RemoteStrategy] = {}
        self._replaceable: dict[int, int] = {}  # engine index -> remote pid whose successor MayJoin allowed
        self._refusals_logged: dict[int, int] = {}  # engine index -> remote pid of the live one, logged once
        self._joining: set[bytes] = set()  # identities whose handshake has not ended (a stop does not end it)
        self._loop = SocketLoop(self._received)
        self._changed = trio.Event()
        self.num_hellos = 0  # Hellos received (from authenticated peers only)

    @property
    def _remote(self) -> range:
        """The engine indices this head takes from other hosts (Ray's, on Ray:
        the group's size follows a scale, and ``config`` with it)."""
        return range(self.config.num_local_engines, self.config.data_parallel_size)

    def socket_options(self) -> dict[str, object]:
        """Options for a socket the head binds for remote engine cores."""
        return {} if self.keys is None else self.keys.server_options()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for remote engine cores until cancelled (then the socket and
        the ZAP handler are closed). ``EngineStartupError`` naming the address
        if it cannot be bound (taken, or not this host's)."""
        async with trio.open_nursery() as nursery:
            if self.authenticator is not None:
                await nursery.start(self.authenticator.run)
            try:
                bound = TrioZmqSocket.bind(zmq.ROUTER, self.address, linger=0, **self.socket_options())
            except zmq.ZMQError as exc:
                raise EngineStartupError(
                    f"cannot listen for engines on other hosts at {self.address} "
                    f"(--data-parallel-rpc-port): {exc.strerror}",
                    stage="handshake",
                ) from None
            with bound as sock:
                self.address = _endpoint(sock)
                task_status.started()
                try:
                    await self._loop.run(sock)
                finally:
                    self._say_leaving(sock)

    def _say_leaving(self, sock: TrioZmqSocket) -> None:
        """This head stops: tell every engine core that is joining it (its
        ``Hello`` waiting for a life, or its workers loading), which would
        otherwise wait for a heartbeat timeout or its start-up deadline. The
        socket then lingers ``LEAVING_S`` for the messages to go out."""
        identities = self._joining | {frames[0] for _, frames in self._hellos.values()}
        if identities:
            _say_leaving_on(sock, [[identity] for identity in identities])

    def joined(self, identity: bytes) -> None:
        """The handshake of the engine core at ``identity`` ended (``Ready``, or a failure)."""
        self._joining.discard(identity)

    def send_nowait(self, frames: Sequence[bytes]) -> None:
        """Queue ``frames`` (identity first) for the hub's task to send."""
        self._loop.send_nowait(frames)

    def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("dropping a handshake message of %d frames", len(frames))
            return
        identity, raw = frames
        try:
            msg = _decode(raw)
        except msgspec.DecodeError as exc:
            log.warning("dropping a malformed handshake message: %s", exc)
            return
        if isinstance(msg, Hello):
            self._hello(msg, frames)
        elif isinstance(msg, MayJoin):
            self.send_nowait([identity, _encode(JoinAnswer(refused=self._may_join(msg)))])
        elif (link := self._links.get(identity)) is not None:
            try:
                link.send_nowait(frames)
            except (trio.WouldBlock, trio.BrokenResourceError):
                pass  # a heartbeat while loading: the next one will do

    def _may_join(self, query: MayJoin) -> str:
        """Why an engine core of ``query.engine_index`` may not join now (see
        the module docstring), or ``""``."""
        index = query.engine_index
        if index not in self._remote:
            return self._not_taken(index)
        live = self._live.get(index)
        if live is None or live.dead is not None:
            return ""
        if live.remote_pid == query.previous_pid:
            self._replaceable[index] = live.remote_pid
            return ""
        if self._refusals_logged.get(index) != live.remote_pid:
            self._refusals_logged[index] = live.remote_pid
            log.warning(
                "a host asked to join as engine-core-%d, which is live (remote pid %d): refused "
                "(two hosts with the same --data-parallel-start-rank?)",
                index,
                live.remote_pid,
            )
        return (
            f"engine {index} is taken: its engine core (remote pid {live.remote_pid}) is live on the head; "
            f"does another host run rank {index} (--data-parallel-start-rank)? If it was this host's, "
            "the head lets it go once silent for its heartbeat timeout"
        )

    def _not_taken(self, index: int) -> str:
        if not self._remote:
            return f"this head takes no engines from other hosts (engine {index} asked)"
        return (
            f"this head takes engines {self._remote.start}..{self._remote.stop - 1} from other hosts, "
            f"not {index} (--data-parallel-start-rank, --data-parallel-size-local)"
        )

    def _hello(self, hello: Hello, frames: list[bytes]) -> None:
        self.num_hellos += 1
        index = hello.engine_index
        if index not in self._remote:
            log.warning("engine-core-%d (pid %d) joined, but %s: ignored", index, hello.pid, self._not_taken(index))
            return
        live = self._live.get(index)
        if live is not None and live.dead is None:
            if self._replaceable.pop(index, None) != live.remote_pid:
                log.warning(
                    "engine-core-%d (remote pid %d) joined, but engine-core-%d (remote pid %d) is live: refused",
                    index,
                    hello.pid,
                    index,
                    live.remote_pid,
                )
                return
            live.replaced(hello.pid)
        log.info("engine-core-%d (remote pid %d) joined", index, hello.pid)
        self._hellos[index] = (hello.pid, frames)
        self._changed.set()
        self._changed = trio.Event()

    async def link(self, life: RemoteStrategy) -> HandshakeLink:
        """Wait (as long as it takes) for a ``Hello`` for ``life``'s engine
        index; the link to that engine core's handshake messages. If
        cancelled, the ``Hello`` stays for the next life."""
        while (hello := self._hellos.pop(life.engine_index, None)) is None:
            await self._changed.wait()
        life.remote_pid, frames = hello
        send, receive = trio.open_memory_channel[list[bytes]](LINK_SIZE)
        send.send_nowait(frames)
        self._links[frames[0]] = send
        self._joining.add(frames[0])
        self._live[life.engine_index] = life
        self._replaceable.pop(life.engine_index, None)
        return HandshakeLink(self, frames[0], receive)

    def unlink(self, identity: bytes) -> None:
        self._links.pop(identity, None)

    def gone(self, life: RemoteStrategy) -> None:
        """``life`` is over."""
        if self._live.get(life.engine_index) is life:
            del self._live[life.engine_index]


class HandshakeLink:
    """One remote engine core's handshake messages, as a ROUTER's frames
    (the socket the handshake expects: ``handshake.HandshakeSocket``)."""

    def __init__(self, hub: RemoteEngines, identity: bytes, receive: trio.MemoryReceiveChannel[list[bytes]]) -> None:
        self._hub = hub
        self.identity = identity
        self._receive = receive

    async def recv_multipart(self) -> list[bytes]:
        return await self._receive.receive()

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        self._hub.send_nowait(frames)

    def __enter__(self) -> HandshakeLink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hub.unlink(self.identity)
        self._receive.close()


class RemoteStrategy:
    """Reach an engine core on another host: it joins through ``hub`` (see the module docstring)."""

    frontend_index = -1  # the engine core's own front-end

    def __init__(self, hub: RemoteEngines, engine_index: int) -> None:
        self.hub = hub
        self.engine_index = engine_index
        self.remote_pid = 0  # the engine core's, as its Hello said (0: none joined yet)
        self._client: EngineCoreClient | None = None
        self._life: trio.CancelScope | None = None

    @property
    def dead(self) -> EngineDeadError | None:
        """Why this life's engine core is dead, or None while it lives (or has not joined)."""
        return None if self._client is None else self._client.dead

    @contextlib.asynccontextmanager
    async def life(self, client: EngineCoreClient) -> AsyncIterator[None]:
        """One life of the remote engine core: it ends when the engine core
        is dead (silent, replaced, or it said so); the hub is told. A life
        that ended during the handshake (replaced, or found hung) raises
        ``EngineStartupError``."""
        self._client = client
        try:
            yield
        finally:
            self.hub.gone(self)
        if client.info is None:
            reason = client.dead or "the handshake did not finish"
            raise EngineStartupError(f"{client.name}: {reason}", stage="handshake", process=client.name)

    async def start(self, client: EngineCoreClient, nursery: trio.Nursery) -> EngineInfo:
        self._life = nursery.cancel_scope
        host = client.config.data_parallel_address
        with await self.hub.link(self) as link:
            opts = self.hub.socket_options()
            input_sock = TrioZmqSocket.bind(zmq.PUSH, f"tcp://{host}:0", linger=0, **opts)
            output_sock = TrioZmqSocket.bind(zmq.PULL, f"tcp://{host}:0", linger=0, **opts)
            handshake = Handshake(client, own_process=False)
            try:
                info = await handshake.run(link, _endpoint(input_sock), _endpoint(output_sock))
            except BaseException as exc:
                input_sock.close()
                output_sock.close()
                if not isinstance(exc, trio.Cancelled):  # a stop leaves it joining: the hub says leaving
                    self.hub.joined(link.identity)
                raise
            self.hub.joined(link.identity)
        client.serve(nursery, input_sock, output_sock)
        nursery.start_soon(self._pinger, client)
        return info

    async def _pinger(self, client: EngineCoreClient) -> None:
        ping = _encode(Ping())
        while True:
            client.send_nowait(ping)
            await trio.sleep(client.config.heartbeat_interval_s)

    def last_words(self, client: EngineCoreClient, sock: TrioZmqSocket) -> None:
        """When the life ends while the engine core lives (this head is
        stopping), say so: ``Ping(leaving=True)``, which ZeroMQ goes on
        sending for ``LEAVING_S`` after the socket closes."""
        if client.dead is None and client.info is not None:
            _say_leaving_on(sock, [[]])

    def hung(self, client: EngineCoreClient) -> None:
        """No process to kill here: the life ends (its sockets close), and the
        engine core, hearing nothing more, stops its workers and rejoins."""
        if self._life is not None:
            self._life.cancel()

    def died(self, client: EngineCoreClient) -> None:
        """Nothing more: the engine core's silence, or the hub, ends the life."""

    def replaced(self, pid: int) -> None:
        """A new engine core with this index joined (remote pid ``pid``): this one is dead at once."""
        assert self._client is not None, "replaced before it joined"
        self._client.stop_now(f"a new engine core (remote pid {pid}) joined in its place: this one is gone")


def _endpoint(sock: TrioZmqSocket) -> str:
    endpoint = sock.socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
