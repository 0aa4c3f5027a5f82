"""The engine core's socket actors: one task owns each ZeroMQ socket.

The input socket actor decodes what the front-end (or an API server) sends
and passes it to the step loop's inbox; the output socket actor sends the
outbox's messages in order. Neither ever blocks the step loop: it only
waits on its socket or its channel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import msgspec
import trio
import zmq

from trioserve.messages import EngineRequest, EngineResponse, Ping
from trioserve.nurseries.engine_core.launch import endpoint
from trioserve.transport.zmq_trio import TrioZmqSocket

log = logging.getLogger("trioserve.engine_core")
_encode = msgspec.msgpack.Encoder().encode


async def input_socket_actor(
    address: str,
    inbox: trio.MemorySendChannel[EngineRequest],
    heard: Callable[[], None] | None = None,
    bind: bool = False,
    note: Callable[[EngineRequest], None] | None = None,
    left: Callable[[], None] | None = None,
    *,
    options: Mapping[str, object] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the input socket (connected to ``address``, or bound there with
    ``bind``, with the socket ``options`` of ``EngineCoreLaunch.socket_options``;
    reports the endpoint, the port the kernel picked included): decode each
    message and pass it to the step loop (``heard`` is told of every message,
    ``note`` is shown each one passed on; a ``Ping`` goes no further, and
    ``left`` is told of one saying the front-end is leaving). Closes a clone
    of ``inbox``, not ``inbox``.

    A message that does not decode is logged and dropped: bad input never
    kills the engine. If cancelled, the socket is closed; nothing is half-read.
    """
    decoder = msgspec.msgpack.Decoder(EngineRequest)
    attach = TrioZmqSocket.bind if bind else TrioZmqSocket.connect
    with attach(zmq.PULL, address, linger=0, **(options or {})) as sock:
        task_status.started(endpoint(sock))
        async with inbox.clone() as mine:
            while True:
                raw = await sock.recv()
                if heard is not None:
                    heard()
                try:
                    msg = decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    log.warning("dropping a malformed message from the front-end: %s", exc)
                    continue
                if isinstance(msg, Ping):
                    if msg.leaving and left is not None:
                        left()
                    continue
                if note is not None:
                    note(msg)
                await mine.send(msg)


async def output_socket_actor(
    address: str,
    outbox: trio.MemoryReceiveChannel[EngineResponse],
    take_unsent: Callable[[], EngineResponse | None] | None = None,
    route: Callable[[EngineResponse], EngineResponse | None] | None = None,
    *,
    options: Mapping[str, object] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the output socket: send every message from the outbox, in order
    (with several API servers, ``route`` sends each its share first and
    returns what is left for the front-end, if anything); a death report that
    found the outbox full (``take_unsent``) goes right after the message being
    sent."""
    with TrioZmqSocket.connect(zmq.PUSH, address, linger=1000, **(options or {})) as sock:
        task_status.started()
        async for msg in outbox:
            for one in (msg, take_unsent() if take_unsent is not None else None):
                routed = one if route is None or one is None else route(one)
                if routed is not None:
                    await sock.send(_encode(routed))
