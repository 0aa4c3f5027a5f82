"""A ZeroMQ socket that one task both receives from and sends on, while
other tasks queue messages for it.

``TrioZmqSocket`` lets one task use a socket at a time, and a receive may
wait for ever; a ROUTER that must answer peers (and send them what other
tasks produce) needs both. ``SocketLoop.run`` owns the socket: between two
receives it sends whatever ``send_nowait`` queued, and ``send_nowait``
cancels a receive under way to make room (a cancelled receive takes nothing
off the socket). ``on_message`` is called with each message's frames, and is
synchronous, so nothing can come between a receive and its handling.

Invariants: only ``run``'s task touches the socket; messages queued go out
in order. The queue is unbounded: the sockets that use this carry handshakes
and one message per engine step, and a ROUTER never blocks a send (at its
high-water mark it drops, so they set ``sndhwm=0``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import trio

from trioserve.transport.zmq_trio import TrioZmqSocket

__all__ = ["SocketLoop"]


class SocketLoop:
    def __init__(self, on_message: Callable[[list[bytes]], None]) -> None:
        self._on_message = on_message
        self._outgoing: deque[Sequence[bytes]] = deque()
        self._receiving: trio.CancelScope | None = None

    def send_nowait(self, frames: Sequence[bytes]) -> None:
        """Queue one message (a ROUTER's: identity first) for ``run`` to send."""
        self._outgoing.append(frames)
        if self._receiving is not None:
            self._receiving.cancel()

    async def run(self, sock: TrioZmqSocket) -> None:
        """Receive and send on ``sock`` until cancelled (it stays open: the caller owns it)."""
        while True:
            while self._outgoing:
                await sock.send_multipart(self._outgoing.popleft())
            with trio.CancelScope() as self._receiving:
                self._on_message(await sock.recv_multipart())
            self._receiving = None
