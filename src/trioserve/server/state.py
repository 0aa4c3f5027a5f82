"""Where the server is in its life, shared by the listener and every connection.

Phases only move forward: ``starting`` -> ``ready`` -> ``stopping``, and any
phase -> ``dead`` (the engine died). ``stopping`` is set once, by the first
of a shutdown request and the engine's death; every connection watches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import trio

from trioserve.server import protocol

if TYPE_CHECKING:
    from trioserve.api import Engine

Phase = Literal["starting", "ready", "stopping", "dead"]


class ServerState:
    def __init__(self) -> None:
        self.phase: Phase = "starting"
        self.engine: Engine | None = None
        self.ready = trio.Event()
        self.stopping = trio.Event()
        self.stop_code = protocol.SHUTDOWN  # the error code of requests the stop ends
        self.close_code = 1001  # the WebSocket close code connections get
        self.close_reason = "server shutting down"
        self.grace_deadline = float("inf")  # trio time by which in-flight requests must end
        self.grace_over = trio.Event()  # set at grace_deadline, or earlier (second signal, engine death)

    @property
    def is_ready(self) -> bool:
        return self.phase == "ready"

    def set_ready(self, engine: Engine) -> None:
        if self.phase == "starting":
            self.engine = engine
            self.phase = "ready"
            self.ready.set()

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop taking requests; those in flight may run ``grace_s`` more seconds.
        A second call ends the grace now."""
        if self.stopping.is_set():
            self.end_grace()
            return
        if self.phase != "dead":
            self.phase = "stopping"
        self.grace_deadline = trio.current_time() + grace_s
        self.stopping.set()

    def engine_died(self) -> None:
        """The engine is gone: every request ends now with ``engine_dead``."""
        if self.phase == "dead":
            return
        self.phase = "dead"
        self.stop_code = protocol.ENGINE_DEAD
        self.close_code = 1011
        self.close_reason = "engine died"
        self.stopping.set()
        self.end_grace()

    def end_grace(self) -> None:
        """Requests still in flight are to end now."""
        self.grace_deadline = min(self.grace_deadline, trio.current_time())
        self.grace_over.set()

    async def run_grace_timer(self) -> None:
        """End the grace at its deadline once a shutdown began. Cancelling leaves nothing behind."""
        await self.stopping.wait()
        await trio.sleep_until(self.grace_deadline)
        self.end_grace()


async def wait_any(*events: trio.Event) -> None:
    """Wait until one of ``events`` is set. If cancelled, nothing is left behind."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)
