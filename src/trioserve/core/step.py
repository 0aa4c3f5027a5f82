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

While ``schedule()`` plans a step, a ``StepPlan`` holds what it has handed
out: ``budget + sum(num_scheduled.values()) == max_num_batched_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from trioserve.core.request import Request
from trioserve.messages import CachedRequestData, NewRequestData, RunnerOutput, SampleLogprobs, SchedulerOutput


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


@dataclass
class StepPlan:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Cleared for the rest of the step by a preemption for blocks, or a
    # waiting request that cannot be admitted (no skipping ahead).
    admitting: bool = True

    def take(self, req_id: str, num_tokens: int, new_block_ids: list[int]) -> None:
        self.budget -= num_tokens
        self.num_scheduled[req_id] = num_tokens
        self.new_block_ids[req_id] = new_block_ids

    def drop(self, req_id: str) -> None:
        """Take back the slice of a request preempted after it got one."""
        self.budget += self.num_scheduled.pop(req_id, 0)
        self.new_block_ids.pop(req_id, None)

    def output(
        self,
        requests: Mapping[str, Request],
        on_workers: set[str],
        block_table: Callable[[str], list[int]],
        finished_req_ids: list[str],
    ) -> SchedulerOutput:
        """The step as the workers get it, once every slice is handed out: all
        of a request they do not hold yet (it joins ``on_workers``), only the
        new blocks of one they do."""
        new_requests, cached_requests = [], []
        for req_id in self.num_scheduled:
            req = requests[req_id]
            if req_id not in on_workers:
                on_workers.add(req_id)
                new_requests.append(
                    NewRequestData(
                        req_id,
                        req.all_token_ids,
                        req.params,
                        block_table(req_id),
                        req.num_computed_tokens,
                        req.num_prompt_tokens,
                    )
                )
            else:
                cached_requests.append(CachedRequestData(req_id, self.new_block_ids[req_id], req.num_computed_tokens))
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_req_ids=finished_req_ids,
        )


def sampled_tokens(runner_output: RunnerOutput) -> dict[str, tuple[int, SampleLogprobs | None]]:
    """The token, and its logprobs if asked for, that the runner sampled for each request.
    Raises ``RuntimeError`` if its lists differ in length."""
    req_ids, token_ids = runner_output.req_ids, runner_output.sampled_token_ids
    logprobs = runner_output.logprobs
    if logprobs is None:
        logprobs = [None] * len(req_ids)
    if not len(req_ids) == len(token_ids) == len(logprobs):
        raise RuntimeError("runner output: req_ids, sampled_token_ids and logprobs differ in length")
    return {req_id: (tok, lp) for req_id, tok, lp in zip(req_ids, token_ids, logprobs, strict=True)}
