"""Continuous batching: chunked prefill, decode, preemption by recompute,
fair admission, prefix caching.

There is no separate prefill phase. Every request has ``num_computed_tokens``, and each step hands
it a slice of the tokens it has not computed yet: all of the rest if the token budget allows, else a
chunk (a long prompt is prefilled over several steps). A decode is a slice of one token. A request
samples a token in a step exactly when its slice reaches the end of its tokens; an embedding request
(``params.pooling``) ends there instead, with its vector.

Steps may be planned ahead: ``schedule()`` can be called again before the
previous step's ``postprocess()`` (the engine core keeps the workers busy with
the next step while it handles the last one's output). Each ``schedule()``
returns a ``Step`` (``core/step.py``), the one record of that step; the caller
keeps the steps in flight and hands each back to ``postprocess()``, in the
order they were made. A token still being sampled counts as one of the
request's tokens (``num_pending``): the next step computes it, and the workers
fill it in, since they append every token they sample to their copy of the
request. Outputs must then be postprocessed in the order their steps were
scheduled. A request planned into a step after its last token (it stops on EOS
or a stop token at the step before) has that extra token dropped; one that will
stop on a length limit is not planned further. With one step at a time, none of
this shows.

Running requests are kept in fair order, waiting requests in one queue per
client (``core/fairness.py``): a running request's rank is the number of running
requests of its client admitted before it, and the order is by rank, then by
admission. With a single client this is the order of admission.

Each ``schedule()``:
1. decodes: every running request that needs exactly one token gets it, in
   running order. When blocks run out the last running request is preempted
   (its blocks freed, ``num_computed_tokens`` reset to 0, back to the front of
   its client's queue); if that was the request being scheduled, this phase
   stops (no request after it is left);
2. prefills: the other running requests, in running order, get slices of what is left of the budget,
   preempting in the same way (a request preempted after it got a slice in this step loses it).
   Waiting requests are admitted at the place they will take in that order, before the first running
   request they outrank, else at the end: a starved client's request does not wait for other
   clients' long prefills. One request per turn (``ClientQueues.next``: the client with the fewest
   running requests, in rotation among equals); admission stops for the step at the first request
   that does not fit or that still has a token in flight (preempted while a step samples for it),
   with no skipping ahead, and once any request was preempted for blocks. With prefix caching on, an
   admitted request starts from its longest cached prefix of whole blocks (``core/prefix_cache.py``:
   never all of its tokens), and the budget counts only the tokens it computes. A request that lacks
   a sequence slot or blocks first preempts running requests that it outranks, last first, if that
   makes it fit (a fairness preemption).
So a client with waiting requests is served before every client that holds
more running requests, and takes a slot (and blocks) from any client holding
at least two more (``core/fairness.py``: why this cannot go back and forth).

A request with a structured-output constraint first waits for its grammar
(WAITING_FOR_GRAMMAR: in no queue, holding nothing, invisible to
``schedule()``) until the engine core hands its constraint over
(``grammar_ready``) or says it cannot be had (``grammar_failed``). From then
on every token appended to it goes through its constraint, and a step that
samples for a constrained request is marked ``awaits_bitmask``: the engine
core sends the allowed tokens once the steps before it are postprocessed.

Invariants (``check_invariants`` raises ``RuntimeError`` naming the one broken):
- every unfinished request is either running (RUNNING), waiting (WAITING) or
  waiting for its grammar (WAITING_FOR_GRAMMAR); the running are in fair
  order, the waiting in their client's queue;
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
that there is no livelock: the first running request, the earliest admitted,
always finishes.
- It is never preempted. A request preempts only requests after it (for
  blocks), or of a rank above its own future rank (for fairness), and the
  first has rank 0; no newcomer sorts before it. Alone, it fits in the cache.
- Its decode comes first; its prefill chunk is the first chunk (nothing is
  admitted before a rank-0 request). A step whose decodes take the whole
  budget admits nothing and completes no prefill, so starts no new decode;
  the decodes in progress each end or are preempted within bounded steps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from trioserve.core.block_manager import BlockManager
from trioserve.core.fairness import ClientQueues, RunningOrder
from trioserve.core.invariants import SchedulerState, check_scheduler
from trioserve.core.lora import Adapters
from trioserve.core.prefix_cache import PrefixCache
from trioserve.core.request import Request, RequestStatus, TokenConstraint
from trioserve.core.step import Step, StepPlan, sampled_tokens
from trioserve.messages import ITERATION_TOKEN_BUCKETS, EngineStats, FinishReason, RunnerOutput, TokenOutput


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
        enable_prefix_caching: bool = False,
        max_loras: int = 1,
    ) -> None:
        for name, value, least in (
            ("max_num_seqs", max_num_seqs, 1),
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("max_model_len", max_model_len, 2),
        ):
            if value < least:
                raise ValueError(f"{name}: must be >= {least} (got {value!r})")
        self.block_manager = BlockManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.prefix_cache = PrefixCache(self.block_manager)
        self.adapters = Adapters(max_loras)  # LoRA adapters served: at most max_loras among the running
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A request stops at this length: the context, or what the whole cache holds.
        self._max_len = min(max_model_len, num_blocks * block_size + 1)
        self.waiting = ClientQueues()
        self.running = RunningOrder()
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._awaiting_grammar: dict[str, Request] = {}  # WAITING_FOR_GRAMMAR, in order of arrival
        self._on_workers: set[str] = set()  # requests whose state the workers hold
        self._finished_req_ids: list[str] = []  # for the next output
        self.num_preemptions = 0  # for blocks
        self.num_fairness_preemptions = 0
        self.num_steps = 0  # steps made by schedule(); the last one's number
        self.num_scheduled_tokens = 0  # tokens computed by every step made so far
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # steps by their tokens (EngineStats)
        self.num_requests = 0  # requests taken by add()

    # --- requests in and out -------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` naming the field if it can never run."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        bm = self.block_manager
        request.check_can_run(self.max_model_len, bm.num_blocks, bm.block_size, self.max_num_batched_tokens)
        self._requests[request.request_id] = request
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self._awaiting_grammar[request.request_id] = request
        else:
            self.waiting.add(request)
        self.num_requests += 1

    def grammar_ready(self, req: Request, constraint: TokenConstraint) -> bool:
        """Give ``req``, waiting for its grammar, its constraint: it joins its
        client's queue. False if it is not waiting for one (aborted meanwhile)."""
        if self._awaiting_grammar.get(req.request_id) is not req:
            return False
        del self._awaiting_grammar[req.request_id]
        req.constraint = constraint
        req.status = RequestStatus.WAITING
        self.waiting.add(req)
        return True

    def grammar_failed(self, req: Request, error: str) -> TokenOutput | None:
        """End ``req``, waiting for its grammar, with ``error``; its output,
        or None if it is not waiting for one."""
        if self._awaiting_grammar.get(req.request_id) is not req:
            return None
        del self._awaiting_grammar[req.request_id]
        self._finish(req, "error")
        return TokenOutput(req.request_id, [], "error", error=error)

    def awaiting_grammar(self) -> list[Request]:
        """The requests waiting for their grammar, oldest first."""
        return list(self._awaiting_grammar.values())

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
                self.running.remove([req])
            elif req.status is RequestStatus.WAITING_FOR_GRAMMAR:
                del self._awaiting_grammar[req_id]
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

    def has_schedulable(self) -> bool:
        """Some unfinished request is not waiting for its grammar: a step may have work."""
        return len(self._requests) > len(self._awaiting_grammar)

    def request_ids(self) -> list[str]:
        """Every unfinished request's id."""
        return list(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._awaiting_grammar)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_fairness_preemptions=self.num_fairness_preemptions,
            num_requests=self.num_requests,
            num_scheduled_tokens=self.num_scheduled_tokens,
            iteration_tokens=list(self.iteration_tokens),
            **self.prefix_cache.stats(),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (requests running keep their blocks).
        Returns how many blocks were forgotten."""
        return self.block_manager.reset_prefix_cache()

    # --- one step --------------------------------------------------------------

    def schedule(self, *, always: bool = False) -> Step | None:
        """Plan the next step, or None when there is nothing for the workers
        (no token to compute, no request to forget), unless ``always``: then
        a step with nothing to compute (a dummy step, as lockstep needs).

        Each scheduled request's ``num_computed_tokens`` moves past its slice
        at once: the workers are trusted to compute it. Every step returned
        must be sent to the workers and later handed to ``postprocess``, after
        every step made before it.
        """
        plan = StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_decodes(plan)
        self._schedule_prefills(plan)
        finished, self._finished_req_ids = self._finished_req_ids, []
        output = plan.output(self._requests, self._on_workers, self.block_manager.block_table, finished)
        if not output.total_num_scheduled_tokens and not output.finished_req_ids and not always:
            return None
        samplers = []
        for req_id, num_tokens in plan.num_scheduled.items():
            req = self._requests[req_id]
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens == req.num_tokens + req.num_pending:
                req.num_pending += 1
                samplers.append(req)
                output.awaits_bitmask |= req.constraint is not None
            self.prefix_cache.register(req)
        self.num_steps += 1
        self.num_scheduled_tokens += output.total_num_scheduled_tokens
        if output.total_num_scheduled_tokens:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, output.total_num_scheduled_tokens)] += 1
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
        sampled = sampled_tokens(runner_output)
        for chunk in runner_output.prompt_logprobs or ():
            req = self._requests.get(chunk.req_id)
            if req is not None and req.params.prompt_logprobs is not None and not req.output_token_ids:
                req.add_prompt_logprobs(chunk.start, chunk.logprobs)
        outputs = []
        finished_running = []
        for req in step.samplers:
            req_id = req.request_id
            if self._requests.get(req_id) is not req:
                continue  # finished since it was scheduled (its id may even be in use again)
            if req.params.pooling is not None:
                if req.status is RequestStatus.RUNNING:
                    finished_running.append(req)
                outputs.append(self._pooled(req, step, runner_output.pooled or {}))
                continue
            if req_id not in sampled:
                raise RuntimeError(f"the runner sampled no token for request {req_id!r} in step {step.number}")
            req.num_pending -= 1
            token_id, logprobs = sampled[req_id]
            allowed = req.append_output_token(token_id)
            self.prefix_cache.register(req)  # the token may fill a block that a step in flight computes
            reason = req.stop_reason(self._max_len) if allowed else "error"
            if reason is not None:
                if req.status is RequestStatus.WAITING:
                    self.waiting.remove(req)  # preempted while this step ran
                else:
                    finished_running.append(req)
                self._finish(req, reason)
            new_logprobs = None if logprobs is None else [logprobs]
            cached = self.prefix_cache.reported(req)
            first = req.num_output_tokens == 1
            prompt_logprobs = None
            if first and req.params.prompt_logprobs is not None:
                prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []  # sent once: no need to keep them
            error = None if allowed else f"sampled token {token_id}, which its structured-output constraint refuses"
            outputs.append(
                TokenOutput(
                    req_id,
                    [token_id],
                    reason,
                    new_logprobs,
                    error,
                    num_cached_tokens=cached,
                    queued_s=req.queued_s if first else None,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        self.running.remove(finished_running)
        return outputs

    def _pooled(self, req: Request, step: Step, pooled: dict[str, bytes]) -> TokenOutput:
        """An embedding request whose prompt ``step`` computed: its end, with its vector."""
        if req.request_id not in pooled:
            raise RuntimeError(f"the runner pooled no vector for request {req.request_id!r} in step {step.number}")
        req.num_pending -= 1
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)  # preempted while this step ran: its vector is whole all the same
        self._finish(req, "stop")
        cached = max(0, req.num_cached_tokens) if self.prefix_cache.enabled else None
        vector, queued = pooled[req.request_id], req.queued_s
        return TokenOutput(req.request_id, [], "stop", num_cached_tokens=cached, queued_s=queued, embedding=vector)

    # --- internals -------------------------------------------------------------

    def _schedule_decodes(self, plan: StepPlan) -> None:
        """Give every running request that needs exactly one token its token, in running order."""
        for req in self.running:
            if plan.budget == 0:
                return
            decode = req.status is RequestStatus.RUNNING and self._num_needed(req) == 1
            if decode and not self._schedule_slice(req, plan):
                return  # it preempted itself: no request after it is left

    def _schedule_prefills(self, plan: StepPlan) -> None:
        """Give the other running requests slices of what is left, in running
        order, admitting waiting requests at their places in that order."""
        i = 0
        while plan.budget > 0:
            req = self.running[i] if i < len(self.running) else None
            if self._admit(plan, before=req):
                continue  # the admitted request now sits at index i
            if req is None:
                return
            if req.request_id not in plan.num_scheduled and not self._schedule_slice(req, plan):
                return  # it preempted itself: no request after it is left
            i += 1

    def _num_needed(self, req: Request) -> int:
        return req.num_tokens + req.num_pending - req.num_computed_tokens

    def _schedule_slice(self, req: Request, plan: StepPlan) -> bool:
        """Give running ``req`` what the budget allows of the tokens it needs.
        False if it had to preempt itself for blocks."""
        num_new = min(self._num_needed(req), plan.budget)
        if num_new <= 0 or self._stops_by_length(req):
            return True
        num_tokens = req.num_computed_tokens + num_new
        if not self._make_room(req, num_tokens, plan):
            return False
        plan.take(req.request_id, num_new, self.block_manager.allocate(req.request_id, num_tokens))
        return True

    def _stops_by_length(self, req: Request) -> bool:
        """The tokens in flight will end ``req`` on a length limit: planning
        it further would only compute a token to drop."""
        return req.num_pending > 0 and req.reaches_length_limit(self._max_len, req.num_pending)

    def _make_room(self, req: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Preempt the last running requests until ``req`` can hold ``num_tokens``.

        False if ``req`` itself had to be preempted.
        """
        while not self.block_manager.can_allocate(req.request_id, num_tokens):
            victim = self.running.pop()
            plan.drop(victim.request_id)
            plan.admitting = False
            self._preempt(victim)
            self.num_preemptions += 1
            if victim is req:
                return False
        return True

    def _admit(self, plan: StepPlan, before: Request | None) -> bool:
        """Admit the waiting request whose turn it is if it outranks running
        ``before`` (None: the end of the order) and fits, or can be made to.
        True if admitted. If it outranks ``before`` but cannot be admitted,
        admission stops for the step."""
        if not plan.admitting:
            return False
        req = self.waiting.next(self.running.num_running)
        if req is None or (before is not None and not self.running.outranks(req, before)):
            return False
        if req.num_pending or not self.adapters.fits(req, self.running):
            plan.admitting = False  # a token in flight (resume it with that token), or no slot for its adapter
            return False
        hit = self.prefix_cache.longest_hit(req)
        num_computed = len(hit) * self.block_manager.block_size
        num_new = min(req.num_tokens - num_computed, plan.budget)
        whole = req.params.pooling is not None and req.params.pooling.whole  # an encoder's: in one step, or later
        if (whole and num_new < req.num_tokens) or not self._make_room_for_newcomer(
            req, num_computed + num_new, hit, plan
        ):
            plan.admitting = False  # no skipping ahead
            return False
        self.waiting.take(req)
        if req.queued_s is None:
            req.queued_s = time.monotonic() - req.arrived_at
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        self.prefix_cache.admitted(req, hit)
        self.running.add(req)
        plan.take(req.request_id, num_new, self.block_manager.allocate(req.request_id, num_computed + num_new, hit))
        return True

    def _make_room_for_newcomer(self, req: Request, num_tokens: int, hit: list[int], plan: StepPlan) -> bool:
        """Whether waiting ``req`` gets a sequence slot and the blocks for
        ``num_tokens`` (starting with the cached blocks ``hit``), once the
        fewest of the running requests it outranks, last first, are preempted
        for fairness. Preempts none unless that is enough."""
        bm = self.block_manager
        num_victims = self.running.num_to_preempt_for(
            req,
            num_seqs=len(self.running) + 1 - self.max_num_seqs,
            num_blocks=bm.blocks_to_take(req.request_id, num_tokens, hit) - bm.num_free_blocks,
            blocks_of=lambda victim: bm.num_blocks_freed_by(victim.request_id, keep=hit),
        )
        if num_victims is None:
            return False
        for _ in range(num_victims):
            victim = self.running.pop()
            plan.drop(victim.request_id)
            self._preempt(victim)
            self.num_fairness_preemptions += 1
        return True

    def _preempt(self, req: Request) -> None:
        """Free the blocks of ``req``, taken off ``running``; it waits to be recomputed."""
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.push_front(req)
        self._forget_on_workers(req.request_id)

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
        state = SchedulerState(
            self.block_manager, self.prefix_cache, self.running, self.waiting, self._requests,
            self._awaiting_grammar, self._on_workers, self.max_num_seqs,
        )  # fmt: skip
        check_scheduler(state, steps_in_flight)
