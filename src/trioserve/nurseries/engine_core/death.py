"""How a failing engine core tells the front-end: ``EngineDead`` once, the moment it knows (``DeathReport``), and
``flush``, which gives the output socket a moment to send it before the process goes."""

from __future__ import annotations

import trio

from trioserve.messages import EngineDead, EngineResponse


class DeathReport:
    """``EngineDead``, sent once, the moment the engine core knows it is
    failing: before its workers are stopped and reaped, so that clients hear
    at once. ``report`` is synchronous (the executor calls it where it finds
    the failure); the message goes through the outbox, after the outputs
    already there, or, when the outbox is full, straight after the message
    the output socket actor is sending."""

    def __init__(self, outbox: trio.MemorySendChannel[EngineResponse]) -> None:
        self._outbox = outbox
        self.reason: str | None = None
        self._unsent: EngineDead | None = None

    def report(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason  # the process's one exit line says it (ChildFailed)
        try:
            self._outbox.send_nowait(EngineDead(reason=reason))
        except trio.WouldBlock:
            self._unsent = EngineDead(reason=reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the output socket is gone: nobody to tell

    def take_unsent(self) -> EngineDead | None:
        unsent, self._unsent = self._unsent, None
        return unsent


async def flush(outbox: trio.MemorySendChannel[EngineResponse]) -> None:
    """Give the output socket a moment (at most half a second, even while
    cancelled) to send what the outbox holds and hand it to ZMQ."""
    with trio.CancelScope(shield=True):
        for _ in range(45):  # polled: nothing tells when a channel's buffer empties
            if not outbox.statistics().current_buffer_used:
                break
            await trio.sleep(0.01)
        await trio.sleep(0.05)
