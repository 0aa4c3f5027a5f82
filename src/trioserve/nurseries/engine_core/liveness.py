"""The engine core's liveness, both ways: its own heartbeats to the front-end, and its watch on a front-end that
is on another host.

- ``heartbeats``: a ``Heartbeat`` every ``heartbeat_interval_s``, saying whether a hang is suspected (the
  executor's ``suspicion``); once requests are served, also the load and the generation state. While the workers
  load they go on the handshake socket, then through the outbox.
- ``FrontEndWatch``: over TCP there is no parent pipe, so the front-end's silence (no message at all, its ``Ping``
  included, for ``heartbeat_timeout_s``) or its word that it stops ends this engine core.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from trioserve.messages import Heartbeat
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.launch import HEAD_LEFT_EXIT
from trioserve.nurseries.engine_core.step_loop import EngineCore
from trioserve.nurseries.supervision.child_main import ChildExit, ChildFailed
from trioserve.transport.silence import Silence


class FrontEndWatch:
    """On TCP there is no parent pipe: the front-end sends a ``Ping`` every
    ``heartbeat_interval_s``, and when nothing at all comes from it for
    ``heartbeat_timeout_s``, it is gone, and ``run`` raises: the engine core
    stops its workers and exits (its headless supervisor reconnects). A
    front-end that stops says so (``Ping(leaving=True)``): then at once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._silence = Silence()  # time this process did not run is excused (transport/silence.py)
        self._scope = trio.CancelScope()
        self._left = False

    def heard(self) -> None:
        self._silence.heard()

    def left(self) -> None:
        """The front-end said it is stopping (``Ping(leaving=True)``)."""
        self._left = True
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            await self._silence.wait(self.timeout_s)
        if self._left:
            raise ChildExit(HEAD_LEFT_EXIT, "the front-end said it is stopping: this engine core goes, to join again")
        raise ChildFailed(f"the front-end sent nothing for {self.timeout_s}s (heartbeat_timeout_s): it is gone")


async def heartbeats(
    send: Callable[[Heartbeat], Awaitable[None]], executor: Executor, core: EngineCore | None = None
) -> None:
    """Send a ``Heartbeat`` every ``heartbeat_interval_s``, saying whether a
    hang is suspected, and once requests are served (``core``), the load and
    whether generation is paused or asleep. Cancelling it leaves nothing
    half-sent."""
    while True:
        if core is None:
            await send(Heartbeat(stalled=executor.suspicion()))
        else:
            await send(Heartbeat(stalled=executor.suspicion(), load=core.load(), state=core.control.state))
        await trio.sleep(executor.config.heartbeat_interval_s)
