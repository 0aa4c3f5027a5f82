"""Continuous batching: chunked prefill, decode, and preemption by recompute.

There is no separate prefill phase. Every request has ``num_computed_tokens``,
and each step hands it a slice of the tokens it has not computed yet: all of
the rest if the token budget allows, else a chunk (a long prompt is prefilled
over several steps). A decode is a slice of one token. A request samples a
token in a step exactly when its slice reaches the end of its tokens.

Steps may be planned ahead: ``schedule()`` can be called again before the
previous step's ``postprocess()`` (the engine core keeps the workers busy
with the next step while it handles the last one's output). Each
``schedule()`` returns a ``Step`` (``core/step.py``), the one record of that
step; the caller keeps the steps in flight and hands each back to
``postprocess()``, in the order they were made. A token still
being sampled counts as one of the request's tokens (``num_pending``): the
next step computes it, and the workers fill it in, since they append every
token they sample to their copy of the request. Outputs must then be
postprocessed in the order their steps were scheduled. A request planned
into a step after its last token (it stops on EOS or a stop token at the
step before) has that extra token dropped; one that will stop on a length
limit is not planned further. With one step at a time, none of this shows.

Each ``schedule()``:
1. running requests, oldest first, get their slices and the blocks to hold
   them; when blocks run out the newest running request is preempted (its
   blocks freed, ``num_computed_tokens`` reset to 0, sent to the front of the
   waiting queue), and if that was the request being scheduled, this phase stops;
2. only if nothing was preempted, waiting requests are admitted in FIFO order
   while the budget, the sequence cap and the free blocks allow; the first
   that does not fit, or that still has a token in flight (preempted while a
   step sampled for it), stops the queue.

Invariants (``check_invariants`` raises ``RuntimeError`` naming the one broken):
- every unfinished request is either running (RUNNING) or waiting (WAITING);
- a waiting request holds no blocks and has ``num_computed_tokens == 0``;
- a running request's table holds exactly ``ceil(num_computed_tokens / block_size)``
  blocks, and the workers hold its state (it has been scheduled at least once);
- ``len(running) <= max_num_seqs``; a step schedules at most
  ``max_num_batched_tokens`` tokens;
- a request the workers have seen and that stops running (finished, aborted,
  preempted) is named in the next output's ``finished_req_ids``, exactly once;
- ``num_pending`` of every request is the number of steps in flight that
  sample for it (``check_invariants`` is given the steps in flight).

A request can never hold more than the whole KV cache, so it also stops with
``"length"`` once it has ``num_blocks * block_size + 1`` tokens (the last
sampled token needs no KV slot), as if that were its context length. With
that, and the oldest running request never preempted for a newer one, the
oldest request always makes progress: there is no livelock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from trioserve.core.block_manager import BlockManager, cdiv
from trioserve.core.request import Request, RequestStatus
from trioserve.core.step import Step
from trioserve.messages import (
    CachedRequestData,
    EngineStats,
    FinishReason,
    NewRequestData,
    RunnerOutput,
    SampleLogprobs,
    SchedulerOutput,
    TokenOutput,
)


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)

    def take(self, req_id: str, num_tokens: int, new_block_ids: list[int]) -> None:
        self.budget -= num_tokens
        self.num_scheduled[req_id] = num_tokens
        self.new_block_ids[req_id] = new_block_ids


class Scheduler:
    """Decides, each step, which tokens of which requests the workers compute."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        for name, value, least in (
            ("max_num_seqs", max_num_seqs, 1),
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("max_model_len", max_model_len, 2),
        ):
            if value < least:
                raise ValueError(f"{name}: must be >= {least} (got {value!r})")
        self.block_manager = BlockManager(num_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A request stops at this length: the context, or what the whole cache holds.
        self._max_len = min(max_model_len, num_blocks * block_size + 1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._on_workers: set[str] = set()  # requests whose state the workers hold
        self._finished_req_ids: list[str] = []  # for the next output
        self.num_preemptions = 0
        self.num_steps = 0  # steps made by schedule(); the last one's number

    # --- requests in and out -------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` naming the field if it can never run."""
        self._check_new_request(request)
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Finish these requests with reason ``"abort"`` and free their blocks now.

        Returns the ids actually aborted; unknown or already finished ids are ignored.
        """
        if isinstance(request_ids, str):
            raise TypeError("abort() takes an iterable of request ids, not one str")
        aborted = []
        for req_id in request_ids:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, "abort")
            aborted.append(req_id)
        return aborted

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(req_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
        )

    # --- one step --------------------------------------------------------------

    def schedule(self) -> Step | None:
        """Plan the next step, or None when there is nothing for the workers
        (no token to compute, no request to forget).

        Each scheduled request's ``num_computed_tokens`` moves past its slice
        at once: the workers are trusted to compute it. Every step returned
        must be sent to the workers and later handed to ``postprocess``, after
        every step made before it.
        """
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        preempted = self._schedule_running(plan)
        if not preempted:
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        if not output.total_num_scheduled_tokens and not output.finished_req_ids:
            return None
        samplers = []
        for req_id, num_tokens in plan.num_scheduled.items():
            req = self._requests[req_id]
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens == req.num_tokens + req.num_pending:
                req.num_pending += 1
                samplers.append(req)
        self.num_steps += 1
        return Step(self.num_steps, output, tuple(samplers))

    def postprocess(self, step: Step, runner_output: RunnerOutput) -> list[TokenOutput]:
        """Append the tokens ``step`` sampled (it must be the oldest step not
        yet postprocessed), finish the requests that must stop, and return
        one output per request that got a token.

        Tokens for requests that finished since the step was made (aborted,
        or stopped in an earlier step) are dropped; a request preempted since
        keeps its token. Raises ``RuntimeError`` if the runner left out a
        request that had to sample.
        """
        sampled = _sampled_tokens(runner_output)
        outputs = []
        any_finished = False
        for req in step.samplers:
            req_id = req.request_id
            if self._requests.get(req_id) is not req:
                continue  # finished since it was scheduled (its id may even be in use again)
            if req_id not in sampled:
                raise RuntimeError(f"the runner sampled no token for request {req_id!r} in step {step.number}")
            req.num_pending -= 1
            token_id, logprobs = sampled[req_id]
            req.append_output_token(token_id)
            reason = req.stop_reason(self._max_len)
            if reason is not None:
                if req.status is RequestStatus.WAITING:
                    self.waiting.remove(req)  # preempted while this step ran
                self._finish(req, reason)
                any_finished = True
            new_logprobs = None if logprobs is None else [logprobs]
            outputs.append(TokenOutput(req_id, [token_id], reason, new_logprobs))
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    # --- internals -------------------------------------------------------------

    def _check_new_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request: {request.request_id!r} has already run")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("prompt: must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in request.prompt_token_ids):
            raise ValueError("prompt: token ids must be non-negative integers")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: {num_prompt} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        bm = self.block_manager
        if num_prompt > bm.num_blocks * bm.block_size:
            raise ValueError(
                f"prompt: {num_prompt} tokens need {cdiv(num_prompt, bm.block_size)} KV blocks, "
                f"but the cache holds only {bm.num_blocks} (of {bm.block_size} tokens)"
            )

    def _schedule_running(self, plan: _StepPlan) -> bool:
        """Give running requests their slices, oldest first. True if any was preempted."""
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens + req.num_pending - req.num_computed_tokens, plan.budget)
            if num_new > 0 and not self._stops_by_length(req):
                if not self._make_room(req, req.num_computed_tokens + num_new):
                    break
                new_blocks = self.block_manager.allocate(
                    req.request_id, req.num_computed_tokens + num_new
                )
                plan.take(req.request_id, num_new, new_blocks)
            i += 1
        return self.num_preemptions > preemptions_before

    def _stops_by_length(self, req: Request) -> bool:
        """The tokens in flight will end ``req`` on a length limit: planning
        it further would only compute a token to drop."""
        return req.num_pending > 0 and req.reaches_length_limit(self._max_len, req.num_pending)

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Preempt the newest running requests until ``req`` can hold ``num_tokens``.

        False if ``req`` itself had to be preempted.
        """
        while not self.block_manager.can_allocate(req.request_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in FIFO order while they fit; never skip ahead."""
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted while a step samples for it: resume it with that token
            num_new = min(req.num_tokens - req.num_computed_tokens, plan.budget)
            if not self.block_manager.can_allocate(req.request_id, num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_blocks = self.block_manager.allocate(req.request_id, num_new)
            plan.take(req.request_id, num_new, new_blocks)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_requests, cached_requests = [], []
        for req_id in plan.num_scheduled:
            req = self._requests[req_id]
            if req_id not in self._on_workers:
                self._on_workers.add(req_id)
                new_requests.append(
                    NewRequestData(
                        req_id,
                        req.all_token_ids,
                        req.params,
                        self.block_manager.block_table(req_id),
                        req.num_computed_tokens,
                        req.num_prompt_tokens,
                    )
                )
            else:
                cached_requests.append(
                    CachedRequestData(req_id, plan.new_block_ids[req_id], req.num_computed_tokens)
                )
        finished, self._finished_req_ids = self._finished_req_ids, []
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            finished_req_ids=finished,
        )

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self._forget_on_workers(req.request_id)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished, free its blocks, forget it. The caller unlinks it from
        ``running`` / ``waiting``."""
        req.finish(reason)
        self.block_manager.free(req.request_id)
        del self._requests[req.request_id]
        self._forget_on_workers(req.request_id)

    def _forget_on_workers(self, req_id: str) -> None:
        if req_id in self._on_workers:
            self._on_workers.discard(req_id)
            self._finished_req_ids.append(req_id)

    # --- checks ----------------------------------------------------------------

    def check_invariants(self, steps_in_flight: Iterable[Step] = ()) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant.
        ``steps_in_flight``: the steps made and not yet postprocessed."""
        self.block_manager.check_invariants()
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        _check(len(running) == len(self.running), "a request is in running twice")
        _check(len(waiting) == len(self.waiting), "a request is in waiting twice")
        _check(not running & waiting, "a request is both running and waiting")
        _check(running | waiting == set(self._requests), "running + waiting != unfinished")
        _check(len(self.running) <= self.max_num_seqs, "more running requests than max_num_seqs")
        _check(self._on_workers == running, "workers hold requests other than the running")
        pending: dict[str, int] = {}
        for step in steps_in_flight:
            for sampler in step.samplers:
                if self._requests.get(sampler.request_id) is sampler:
                    pending[sampler.request_id] = pending.get(sampler.request_id, 0) + 1
        for req in self._requests.values():
            _check(req.num_pending == pending.get(req.request_id, 0), f"{req!r}: pending != steps in flight for it")
            _check(req.num_computed_tokens <= req.num_tokens + req.num_pending, f"{req!r} computed past its tokens")
        block_size = self.block_manager.block_size
        for req in self.running:
            _check(req.status is RequestStatus.RUNNING, f"{req!r} is running but not RUNNING")
            num_blocks = len(self.block_manager.block_table(req.request_id))
            _check(
                num_blocks == cdiv(req.num_computed_tokens, block_size),
                f"{req!r} holds {num_blocks} blocks for its computed tokens",
            )
        for req in self.waiting:
            _check(req.status is RequestStatus.WAITING, f"{req!r} is waiting but not WAITING")
            _check(req.num_computed_tokens == 0, f"{req!r} is waiting with computed tokens")
            _check(not self.block_manager.block_table(req.request_id), f"{req!r} waits holding blocks")


def _sampled_tokens(
    runner_output: RunnerOutput,
) -> dict[str, tuple[int, SampleLogprobs | None]]:
    req_ids, token_ids = runner_output.req_ids, runner_output.sampled_token_ids
    logprobs = runner_output.logprobs
    if logprobs is None:
        logprobs = [None] * len(req_ids)
    if not len(req_ids) == len(token_ids) == len(logprobs):
        raise RuntimeError("runner output: req_ids, sampled_token_ids and logprobs differ in length")
    return {req_id: (tok, lp) for req_id, tok, lp in zip(req_ids, token_ids, logprobs)}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
