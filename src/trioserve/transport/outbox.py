"""A queue of messages for one socket, kept in the order they were put.

Two kinds of sender share it. New work (a request, a stats or control call)
waits while ``capacity`` messages are queued: that is the back-pressure a
lagging peer puts on its callers. Messages that must never wait (an abort, a
lockstep wave start, sent from code that cannot block) go in at once, past
the capacity if need be, but still behind everything put before them: an
abort can never reach the peer ahead of the request it aborts. How far past
the capacity the queue can grow is bounded by the callers (one abort per
request in flight).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._queue: deque[T] = deque()
        self._not_full = trio.lowlevel.ParkingLot()
        self._not_empty = trio.lowlevel.ParkingLot()

    def __len__(self) -> int:
        return len(self._queue)

    async def put(self, item: T) -> None:
        """Queue ``item`` once fewer than ``capacity`` messages are queued. If
        cancelled, it is not queued (and if it was queued, this returns)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while len(self._queue) >= self.capacity:
            await self._not_full.park()
        self.put_nowait(item)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def put_nowait(self, item: T) -> None:
        """Queue ``item`` now, behind everything already queued, however many."""
        self._queue.append(item)
        self._not_empty.unpark()

    async def get(self) -> T:
        """The oldest message, once there is one."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._queue:
            await self._not_empty.park()
        item = self._queue.popleft()
        if len(self._queue) < self.capacity:
            self._not_full.unpark()  # one waiting sender, for the one free place
        await trio.lowlevel.cancel_shielded_checkpoint()
        return item
