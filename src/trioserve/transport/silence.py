"""How long a peer has been silent, not counting the time this process did not run.

Every watchdog of the tree reads "nothing heard from a peer for T seconds"
as "the peer is hung" (an engine core, a worker, the head). That reading is
wrong when the silence was the watcher's own: a process that was stopped
(``SIGSTOP``, a paused container or VM) or whose event loop was held up
could not read what the peer sent, and on waking finds the deadline long
past with the peer's messages still waiting, unread, in its sockets. Killing
the peer then would kill a healthy engine.

So a watch wakes at least every ``TICK_MAX_S`` and compares the time it
woke with the time it asked for: a wake-up later than asked by more than
``LATE_S`` means this process was away for that long, and that time is
excused (``Silence.excuse``): the silence is counted from no earlier than
where it stood plus the time away. A peer that is really silent is still
found, later by the time this process was away.

Invariants: the silence never counts time this process was seen to be
away; it never goes below zero; hearing from the peer resets it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

LATE_S = 0.1  # a wake-up later than this is time this process was away, not the peer's silence
TICK_MAX_S = 1.0  # a watch wakes at least this often, to see its own absences


async def sleep_noting_absence(seconds: float) -> float:
    """Sleep ``seconds``; how long this process was away meanwhile (how much
    later than asked it woke, when more than ``LATE_S``; else 0)."""
    wake = trio.current_time() + seconds
    await trio.sleep_until(wake)
    late = trio.current_time() - wake
    return late if late > LATE_S else 0.0


class Silence:
    """The silence of one peer. Its last message's time comes from
    ``last_heard`` (a clock reading), or from calls of ``heard``."""

    def __init__(self, last_heard: Callable[[], float] | None = None) -> None:
        self._heard_at = trio.current_time()
        self._last_heard = last_heard if last_heard is not None else lambda: self._heard_at
        self._floor = -math.inf  # the silence counts from no earlier than this (time away excused)
        self.expired = False  # set when ``wait`` (or ``watched``) found the peer silent

    def heard(self) -> None:
        """A message came from the peer now."""
        self._heard_at = trio.current_time()

    def silent_for(self) -> float:
        """Seconds since the peer was last heard, less the time this process
        was seen to be away since."""
        return max(0.0, trio.current_time() - max(self._last_heard(), self._floor))

    def excuse(self, away_s: float) -> None:
        """This process was away for ``away_s`` seconds: not the peer's silence."""
        if away_s > 0:
            now = trio.current_time()
            self._floor = min(now, now - self.silent_for() + away_s)

    async def wait(self, timeout_s: float) -> None:
        """Return once the peer has been silent for ``timeout_s`` (``expired``
        is then set). Cancelling it leaves nothing behind."""
        tick = min(TICK_MAX_S, max(timeout_s / 4, 0.01))
        while (left := timeout_s - self.silent_for()) > 0:
            self.excuse(await sleep_noting_absence(min(left, tick)))
        self.expired = True

    @asynccontextmanager
    async def watched(self, timeout_s: float) -> AsyncIterator[Silence]:
        """Run the body until it ends, or until the peer has been silent for
        ``timeout_s``: then the body is cancelled (and ``expired`` set)."""
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await self.wait(timeout_s)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            yield self
            nursery.cancel_scope.cancel()
