"""The engine core's side of several API-server processes (``serve --api-server-count M``).

Besides the sockets of the front-end that started it (its supervisor), the
engine core then binds two more, at the addresses ``HandshakeInit.frontends``
gives: a PULL that every API server's PUSH connects to (requests, aborts,
calls: fair-queued among them), and a ROUTER that every API server's DEALER
connects to. An API server says ``Attach(index)`` there and gets
``Attached(EngineInfo)``; from then on it gets the outputs of the requests it
sent (each ``AddRequest`` names its API server), and every heartbeat, load
report, reply to a call (call ids are unique per API server) and
``EngineDead``. Its supervisor gets all of those too, and the outputs of its
own requests (none, in that setup).

Invariants: a request's outputs go to the API server that sent it, and only
to it, until its last one (then it is forgotten; an abort forgets it too);
only the socket loop's task touches the ROUTER.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
import trio
import zmq

from trioserve.messages import (
    AbortRequests,
    AddRequest,
    Attach,
    Attached,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineResponse,
    FrontEndsInit,
    TokenOutput,
    WaveNotice,
)
from trioserve.transport.router import SocketLoop
from trioserve.transport.zmq_trio import TrioZmqSocket

_encode = msgspec.msgpack.Encoder().encode
_decode_attach = msgspec.msgpack.Decoder(Attach).decode


class ApiServers:
    """Which API server each request came from, and the ROUTER to them all."""

    def __init__(self) -> None:
        self._identities: dict[int, bytes] = {}  # API server index -> its DEALER's identity
        self._sender: dict[str, int] = {}  # request id -> the API server that sent it
        self._loop = SocketLoop(self._received)
        self._attached = b""

    async def run(
        self,
        init: FrontEndsInit,
        info: EngineInfo,
        inbox: trio.MemorySendChannel[EngineRequest],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind both sockets and serve the API servers until cancelled."""
        from trioserve.nurseries.engine_core import input_socket_actor  # the engine core imports this module

        self._attached = _encode(Attached(info=info))
        with TrioZmqSocket.bind(zmq.ROUTER, init.output_address, linger=0, sndhwm=0) as router:
            async with trio.open_nursery() as nursery:
                await nursery.start(input_socket_actor, init.input_address, inbox, None, True, self.note)
                task_status.started()
                await self._loop.run(router)

    def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        identity, raw = frames
        try:
            attach = _decode_attach(raw)
        except msgspec.DecodeError:
            return
        self._identities[attach.frontend] = identity
        self._loop.send_nowait([identity, self._attached])

    def note(self, msg: EngineRequest) -> None:
        """A message from an API server, on its way to the step loop."""
        if isinstance(msg, AddRequest) and msg.frontend >= 0:
            self._sender[msg.request_id] = msg.frontend
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self._sender.pop(request_id, None)

    def route(self, msg: EngineResponse) -> EngineResponse | None:
        """Send the API servers their share of ``msg``; what is left for the
        engine core's own front-end (None: nothing)."""
        if isinstance(msg, EngineOutputs):
            own: list[TokenOutput] = []
            theirs: dict[int, list[TokenOutput]] = defaultdict(list)
            for output in msg.outputs:
                sender = self._sender.get(output.request_id, -1)
                if output.finish_reason is not None:
                    self._sender.pop(output.request_id, None)
                (own if sender < 0 else theirs[sender]).append(output)
            for sender, outputs in theirs.items():
                if (identity := self._identities.get(sender)) is not None:
                    self._loop.send_nowait([identity, _encode(EngineOutputs(outputs=outputs))])
            return EngineOutputs(outputs=own) if own else None
        if not isinstance(msg, WaveNotice) and self._identities:
            raw = _encode(msg)
            for identity in self._identities.values():
                self._loop.send_nowait([identity, raw])
        return msg
