"""One model step, from the moment it is planned until its tokens are taken.

A ``Step`` is the only record of a step in flight. The scheduler makes it
(``Scheduler.schedule``), the step loop owns the queue of the steps sent to
the workers and not yet postprocessed, and hands each one to the executor
(to send it, and to take its output) and back to the scheduler (to
postprocess it). Nobody else keeps a queue of steps.

Invariants: step numbers start at 1 and grow by one with every step the
scheduler makes; steps are postprocessed in the order of their numbers;
``samplers`` are the requests, as objects, that the step samples a token
for, so a token in flight for a request that ended meanwhile can never reach
a new request that reuses its id.
"""

from __future__ import annotations

from dataclasses import dataclass

from trioserve.core.request import Request
from trioserve.messages import SchedulerOutput


@dataclass(frozen=True, eq=False)
class Step:
    """A step in flight: its number, what it runs, and who it samples for."""

    number: int
    scheduled: SchedulerOutput
    samplers: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (0 for a step that only tells the
        workers which requests to forget)."""
        return self.scheduled.total_num_scheduled_tokens
