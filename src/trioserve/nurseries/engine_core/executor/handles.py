"""One worker as the worker group sees it, and the errors workers fail with.

A ``WorkerHandle`` is filled in as its worker starts (``group.WorkerGroup``):
its process (once spawned), its message bridge and the two channels it
gives. ``WorkerError`` names the worker, the executor's stage (and step)
and, when it exited, its exit code or signal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import trio

from trioserve.errors import StartupStage
from trioserve.messages import FromWorker, ToWorker, WorkerFailed
from trioserve.nurseries.supervision.process import ChildProcess
from trioserve.transport.framing import MessageBridge
from trioserve.transport.silence import Silence

ExecutorStage = StartupStage | Literal["step"]


class WorkerError(RuntimeError):
    """A worker failed: it exited, reported a failure, closed its stream, or
    did not answer in time. ``stage`` is the executor's stage (``spawn``,
    ``model-load``, ``kv-cache``, ``step``), ``process`` the worker's name,
    ``exit_code`` its exit status if it exited (negative: the signal)."""

    def __init__(self, message: str, *, stage: ExecutorStage, process: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.process = process
        self.exit_code = exit_code


class StepTimeout(WorkerError):
    """Workers did not answer a step within its deadline (``core.step_timing``)."""


class WorkerHung(WorkerError):
    """A worker sent nothing, not even a heartbeat, for ``heartbeat_timeout_s``."""


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the group sees it; filled in as it starts."""

    rank: int
    exited: trio.Event = field(default_factory=trio.Event)  # set once it is reaped
    stream_closed: trio.Event = field(default_factory=trio.Event)  # set once its bridge ended
    process: ChildProcess | None = None
    bridge: MessageBridge[ToWorker, FromWorker] | None = None
    outbox: trio.MemorySendChannel[ToWorker] | None = None
    inbox: trio.MemoryReceiveChannel[FromWorker] | None = None

    @property
    def heard(self) -> bool:
        """A message (a heartbeat at least) came from it since it started."""
        return self.bridge is not None and self.bridge.num_received > 0

    silence: Silence = field(init=False)  # time the engine core itself did not run is excused

    def __post_init__(self) -> None:
        self.silence = Silence(self._last_heard)

    def _last_heard(self) -> float:
        """When it last sent anything (heartbeats included); before its bridge
        exists, now."""
        return trio.current_time() if self.bridge is None else self.bridge.last_received_at

    def silent_for(self) -> float:
        """Seconds since it last sent anything (heartbeats included), less
        the time the engine core itself was seen to be away."""
        return self.silence.silent_for()

    @property
    def name(self) -> str:
        return f"worker-{self.rank}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def has_reply(self) -> bool:
        return self.inbox is not None and self.inbox.statistics().current_buffer_used > 0

    def drain(self) -> tuple[int, str | None]:
        """Empty its inbox (once it is dead): how many replies were still
        waiting there, and the message of its ``WorkerFailed``, if any."""
        num_replies, failure = 0, None
        while self.inbox is not None:
            try:
                msg = self.inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(msg, WorkerFailed):
                failure = msg.message
            else:
                num_replies += 1
        return num_replies, failure
