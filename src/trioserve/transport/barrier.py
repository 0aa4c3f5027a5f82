"""The fake runner's data-parallel collective: an OR across the engines, on
ZeroMQ, blocking (a worker's conversation thread calls it once per step).

The worker of data-parallel rank 0 binds a ROUTER at the rendezvous; the
others connect a DEALER. Each step every rank sends its flag; rank 0 waits
for all of them, ORs them with its own, and answers each. Like a real
all-reduce, a rank blocks until every rank has joined the same step, so an
engine that skipped a step would hold the others: lockstep mode's whole
point. Only ``ipc://`` addresses in the front-end's private directory are
used; nothing listens beyond this machine.
"""

from __future__ import annotations

from typing import Any

import zmq

from trioserve.transport.zmq_trio import zmq_context


class ZmqAnyOf:
    """``any_of(flag)``: True when any rank's ``flag`` is True."""

    def __init__(self, address: str, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.rank = rank
        self.size = size
        self._sock: zmq.Socket[Any] = zmq_context().socket(zmq.ROUTER if rank == 0 else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if rank == 0:
            self._sock.bind(address)
        else:
            self._sock.connect(address)

    def any_of(self, flag: bool) -> bool:
        """Block until every rank joined this step; the OR of their flags."""
        if self.size == 1:
            return flag
        if self.rank != 0:
            self._sock.send(b"1" if flag else b"0")
            return self._sock.recv() == b"1"
        peers: list[bytes] = []
        result = flag
        while len(peers) < self.size - 1:
            identity, payload = self._sock.recv_multipart()
            peers.append(identity)
            result = result or payload == b"1"
        answer = b"1" if result else b"0"
        for identity in peers:
            self._sock.send_multipart([identity, answer])
        return result

    def close(self) -> None:
        self._sock.close(linger=0)
