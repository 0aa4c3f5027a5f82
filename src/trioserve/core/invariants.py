"""The scheduler's invariants, checked (``Scheduler.check_invariants``).

They are listed in ``core/scheduler.py``'s docstring; this module only
checks them, reading the scheduler's state (its internals included: it is
part of the scheduler, kept apart so that the scheduler reads as the
algorithm). Each failure raises ``RuntimeError`` naming the invariant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trioserve.core.block_manager import BlockManager, cdiv
from trioserve.core.fairness import ClientQueues, RunningOrder
from trioserve.core.prefix_cache import PrefixCache, check_shared_blocks
from trioserve.core.request import Request, RequestStatus
from trioserve.core.step import Step


@dataclass(frozen=True)
class SchedulerState:
    """What the invariants read of a scheduler: its parts, internals included."""

    block_manager: BlockManager
    prefix_cache: PrefixCache
    running: RunningOrder
    waiting: ClientQueues
    requests: dict[str, Request]  # every unfinished request
    awaiting_grammar: dict[str, Request]  # those waiting for their grammar
    on_workers: set[str]  # the requests whose state the workers hold
    max_num_seqs: int


def check_scheduler(sched: SchedulerState, steps_in_flight: Iterable[Step]) -> None:
    """Raise ``RuntimeError`` naming the first broken invariant of ``sched``.
    ``steps_in_flight``: the steps made and not yet postprocessed."""
    bm = sched.block_manager
    bm.check_invariants()
    sched.running.check_invariants()
    sched.waiting.check_invariants()
    requests = sched.requests
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    awaiting = set(sched.awaiting_grammar)
    _check(not running & waiting, "a request is both running and waiting")
    _check(not (running | waiting) & awaiting, "a request waiting for its grammar is also queued or running")
    _check(running | waiting | awaiting == set(requests), "running + waiting + waiting for grammar != unfinished")
    _check(len(sched.running) <= sched.max_num_seqs, "more running requests than max_num_seqs")
    _check(sched.on_workers == running, "workers hold requests other than the running")
    pending: dict[str, int] = {}
    for step in steps_in_flight:
        for sampler in step.samplers:
            if requests.get(sampler.request_id) is sampler:
                pending[sampler.request_id] = pending.get(sampler.request_id, 0) + 1
    for req in requests.values():
        _check(req.num_pending == pending.get(req.request_id, 0), f"{req!r}: pending != steps in flight for it")
        _check(req.num_computed_tokens <= req.num_tokens + req.num_pending, f"{req!r} computed past its tokens")
        _check(req.num_cached_tokens <= req.num_prompt_tokens, f"{req!r} has more cached tokens than prompt")
    for req in sched.running:
        _check(req.status is RequestStatus.RUNNING, f"{req!r} is running but not RUNNING")
        num_blocks = len(bm.block_table(req.request_id))
        _check(
            num_blocks == cdiv(req.num_computed_tokens, bm.block_size),
            f"{req!r} holds {num_blocks} blocks for its computed tokens",
        )
    for req in sched.waiting:
        _check(req.num_computed_tokens == 0, f"{req!r} is waiting with computed tokens")
        _check(not bm.block_table(req.request_id), f"{req!r} waits holding blocks")
    for req in sched.awaiting_grammar.values():
        _check(req.status is RequestStatus.WAITING_FOR_GRAMMAR, f"{req!r} waits for a grammar but not in that state")
        _check(req.num_computed_tokens == 0 and not req.output_token_ids, f"{req!r} ran before its grammar")
        _check(not bm.block_table(req.request_id), f"{req!r} waits for its grammar holding blocks")
    check_shared_blocks(sched.running, bm)
    cache = sched.prefix_cache
    _check(0 <= cache.num_hits <= cache.num_queries, "more prefix cache hits than queries")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
