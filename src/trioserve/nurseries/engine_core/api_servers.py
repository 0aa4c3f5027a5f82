"""The engine core's side of several API-server processes (``serve --api-server-count M``).

Besides the sockets of the front-end that started it (its supervisor), the
engine core then binds two more, where ``HandshakeInit.frontends`` says: a
PULL that every API server's PUSH connects to (requests, aborts, calls:
fair-queued among them), and a ROUTER that every API server's DEALER
connects to. An API server says ``Attach(index, engine)`` there and gets
``Attached`` (its ``EngineInfo``, and whether it is paused or asleep, as its
last reply or heartbeat said); from then on it gets the outputs of the requests it
sent (each ``AddRequest`` names its API server), and every heartbeat, load
report, reply to a call (call ids are unique per API server) and
``EngineDead``. Its supervisor gets all of those too, and the outputs of its
own requests (none, in that setup). The engine core reports where it bound
them in its ``Ready``; the supervisor tells its API servers
(``frontend/engines/attached.py``).

Where. On the head's host, ``ipc://`` addresses in the supervisor's private
directory. On another host (``BIND_TCP``), TCP: on ``$TRIOSERVE_API_SERVERS_HOST``
(``serve --headless --headless-address``), by default this host's address on
the route to the head (the source address the kernel picks for it), and on
``$TRIOSERVE_API_SERVERS_PORT`` (the PULL) and the port after it (the
ROUTER; ``--headless-port``), by default ports the kernel picks. There both
sockets are CURVE servers (unless ``$TRIOSERVE_INSECURE_TCP``), and this
process runs the ZAP handler (``transport/curve.py``): a peer without the
deployment's key never reaches the step loop. The engine core binds, rather
than connecting to each API server as vLLM's do, because our API servers
are restarted one by one (each restart would have to reach every engine
core with its new addresses), while an engine core's addresses change only
with its life, which its supervisor sees anyway; the cost is that the head
must reach this host, on these ports.

Orphans. A request whose API server is gone has nobody to read it, and
must not keep its batch slot and KV blocks. Two things end them: the
supervising process, seeing API server k's process (pid P) die, sends
``AbortRequests(frontend=k, frontend_pid=P)`` on its own connection, which
aborts every request that process sent (``note`` fills in their ids); and
an ``Attach`` naming a new life of API server k aborts every request its
earlier lives sent (a restart, or a life its watchdog ended while the
engine core lived on), which also covers a supervisor that could not say.

Invariants: a request's outputs go to the API server that sent it, and only
to it, until its last one (then it is forgotten; an abort forgets it too);
only the socket loop's task touches the ROUTER; an ``Attach`` for another
engine index is not answered; no request outlives the API-server life that
sent it once a later life attached.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import trio
import zmq

from trioserve.messages import (
    BIND_TCP,
    AbortRequests,
    AddRequest,
    Attach,
    Attached,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineResponse,
    FrontEndsInit,
    Heartbeat,
    TokenOutput,
    WaveNotice,
)
from trioserve.nurseries.engine_core.launch import EngineCoreLaunch, endpoint
from trioserve.nurseries.engine_core.sockets import input_socket_actor
from trioserve.rpc import ControlReply, GenerationState
from trioserve.transport.curve import CurveAuthenticator
from trioserve.transport.router import SocketLoop
from trioserve.transport.zmq_trio import TrioZmqSocket

log = logging.getLogger("trioserve.engine_core")
_encode = msgspec.msgpack.Encoder().encode
_decode_attach = msgspec.msgpack.Decoder(Attach).decode


class Life(NamedTuple):
    """One life of an API server's client of this engine core (its ``Attach``)."""

    frontend: int  # the API server's index
    pid: int
    life: int


class ApiServers:
    """Which API server each request came from, and the ROUTER to them all."""

    def __init__(self, engine_index: int = -1, launch: EngineCoreLaunch | None = None) -> None:
        self.engine_index = engine_index
        # How the engine core was started: where to bind on TCP, and with which keys.
        self._launch = (
            launch if launch is not None else EngineCoreLaunch(handshake_address="", engine_index=engine_index)
        )
        self._identities: dict[int, bytes] = {}  # API server index -> its DEALER's identity
        self._lives: dict[int, Life] = {}  # API server index -> its latest life that attached
        self._sender: dict[str, Life] = {}  # request id -> the life that sent it
        self._loop = SocketLoop(self._received)
        self._info: EngineInfo | None = None
        self._state = GenerationState()  # as the engine core's last reply or heartbeat said
        self._orphans: trio.MemorySendChannel[EngineRequest] | None = None  # the step loop's inbox, while running
        self._nursery: trio.Nursery | None = None

    async def run(
        self,
        init: FrontEndsInit,
        info: EngineInfo,
        inbox: trio.MemorySendChannel[EngineRequest],
        *,
        task_status: trio.TaskStatus[FrontEndsInit] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind both sockets (see the module docstring), report where they
        listen, and serve the API servers until cancelled (then the sockets
        and the ZAP handler are closed). ``zmq.ZMQError`` if they cannot be
        bound, ``OSError`` if there is no route to the head to bind on."""
        self._info = info
        input_address, output_address = init.input_address, init.output_address
        if BIND_TCP in (input_address, output_address):
            input_address, output_address = await tcp_addresses(self._launch)
        async with trio.open_nursery() as nursery:
            self._orphans, self._nursery = inbox, nursery
            keys = self._launch.curve_keys(output_address) if output_address.startswith("tcp://") else None
            if keys is not None:
                await nursery.start(CurveAuthenticator(keys).run)  # before any server socket is bound
            options = self._launch.socket_options(output_address, bind=True)
            with TrioZmqSocket.bind(zmq.ROUTER, output_address, linger=0, sndhwm=0, **options) as router:
                receive = functools.partial(
                    input_socket_actor, options=self._launch.socket_options(input_address, bind=True)
                )
                bound_input = await nursery.start(receive, input_address, inbox, None, True, self.note)
                task_status.started(FrontEndsInit(input_address=bound_input, output_address=endpoint(router)))
                await self._loop.run(router)

    def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        identity, raw = frames
        try:
            attach = _decode_attach(raw)
        except msgspec.DecodeError:
            return
        if attach.engine not in (-1, self.engine_index):
            return  # it means another engine core: let it find the right one
        life = Life(attach.frontend, attach.pid, attach.life)
        if self._lives.get(attach.frontend, life) != life:
            # A new life sends nothing before its Attached: all of this API server's requests are the last ones'.
            self._abort(self._forget(lambda sender: sender.frontend == life.frontend))
        self._lives[attach.frontend] = life
        self._identities[attach.frontend] = identity
        assert self._info is not None
        # Paused or asleep from its first moment, not "ready" until the next heartbeat says otherwise.
        self._loop.send_nowait([identity, _encode(Attached(info=self._info, state=self._state))])

    def _forget(self, orphaned: Callable[[Life], bool]) -> list[str]:
        """Forget the requests whose sender is ``orphaned``; their ids."""
        ids = [request_id for request_id, sender in self._sender.items() if orphaned(sender)]
        for request_id in ids:
            del self._sender[request_id]
        return ids

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids and self._orphans is not None and self._nursery is not None:
            log.info("aborting %d requests of an API server's earlier life", len(request_ids))
            self._nursery.start_soon(self._send_abort, self._orphans, AbortRequests(request_ids=request_ids))

    @staticmethod
    async def _send_abort(inbox: trio.MemorySendChannel[EngineRequest], abort: AbortRequests) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):  # the step loop has ended
            await inbox.send(abort)

    def note(self, msg: EngineRequest) -> None:
        """A message on its way to the step loop, from an API server or the
        supervising process (an ``AbortRequests`` naming a dead API server
        gets the ids of its requests)."""
        if isinstance(msg, AddRequest) and msg.frontend >= 0:
            self._sender[msg.request_id] = self._lives.get(msg.frontend, Life(msg.frontend, 0, 0))
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self._sender.pop(request_id, None)
            if msg.frontend >= 0:
                dead = Life(msg.frontend, msg.frontend_pid, 0)
                msg.request_ids.extend(self._forget(lambda sender: sender[:2] == dead[:2]))

    def route(self, msg: EngineResponse) -> EngineResponse | None:
        """Send the API servers their share of ``msg``; what is left for the
        engine core's own front-end (None: nothing)."""
        if isinstance(msg, EngineOutputs):
            own: list[TokenOutput] = []
            theirs: dict[int, list[TokenOutput]] = defaultdict(list)
            for output in msg.outputs:
                sender = self._sender.get(output.request_id)
                if output.finish_reason is not None:
                    self._sender.pop(output.request_id, None)
                (own if sender is None else theirs[sender.frontend]).append(output)
            for frontend, outputs in theirs.items():
                if (identity := self._identities.get(frontend)) is not None:
                    self._loop.send_nowait([identity, _encode(EngineOutputs(outputs=outputs))])
            return EngineOutputs(outputs=own) if own else None
        if isinstance(msg, ControlReply | Heartbeat) and msg.state is not None:
            self._state = msg.state
        if not isinstance(msg, WaveNotice) and self._identities:
            raw = _encode(msg)
            for identity in self._identities.values():
                self._loop.send_nowait([identity, raw])
        return msg


async def tcp_addresses(launch: EngineCoreLaunch) -> tuple[str, str]:
    """Where an engine core on another host listens for the API servers
    (input, output): see the module docstring."""
    host = launch.api_servers_host or await address_towards(launch.handshake_address)
    port = launch.api_servers_port
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1 if port else 0}"


async def address_towards(address: str) -> str:
    """This host's address on the route to ``address`` (``tcp://host:port``):
    the source address the kernel picks for it, read from a UDP socket
    connected there (no packet is sent)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    family, kind, proto, _, target = (await trio.socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM))[0]
    with trio.socket.socket(family, kind, proto) as probe:
        await probe.connect(target)
        local: str = probe.getsockname()[0]
        return local
