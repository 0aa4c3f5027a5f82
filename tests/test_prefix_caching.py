"""The scheduler with prefix caching: where requests start, what the budget
counts, what is reported, and how preemption, aborts and resets treat shared blocks."""

from __future__ import annotations

from helpers.scheduling import make_request, make_scheduler

from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.messages import RunnerOutput, TokenOutput

PREFIX = list(range(10, 26))  # 16 tokens: four blocks of 4


def caching_scheduler(**overrides: int | bool) -> Scheduler:
    """``make_scheduler`` with room for the prefix and prefix caching on."""
    return make_scheduler(**{"num_blocks": 32, "max_model_len": 128, "enable_prefix_caching": True, **overrides})


def request(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return make_request(req_id, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)


def run(sched: Scheduler, planned: Step, token: int = 7) -> list[TokenOutput]:
    req_ids = [r.request_id for r in planned.samplers]
    return sched.postprocess(planned, RunnerOutput(req_ids, [token] * len(req_ids)))


def step(sched: Scheduler) -> tuple[Step, list[TokenOutput]]:
    planned = sched.schedule()
    assert planned is not None
    return planned, run(sched, planned)


def drain(sched: Scheduler) -> list[TokenOutput]:
    outputs = []
    while sched.has_unfinished():
        outputs += step(sched)[1]
        sched.check_invariants()
    return outputs


def test_a_repeated_prefix_is_not_computed_again() -> None:
    sched = caching_scheduler()
    sched.add(request("a", [*PREFIX, 1, 2]))
    drain(sched)
    sched.add(request("b", [*PREFIX, 3, 4, 5]))
    planned, _ = step(sched)
    (new,) = planned.scheduled.new_requests
    assert new.num_computed_tokens == 16
    assert planned.scheduled.num_scheduled_tokens == {"b": 3}
    assert planned.samplers == (sched.get_request("b"),)  # it samples in this very step


def test_the_budget_counts_only_computed_tokens() -> None:
    sched = caching_scheduler(max_num_batched_tokens=6)
    sched.add(request("a", [*PREFIX, 1]))
    drain(sched)
    sched.add(request("b", [*PREFIX, 3, 4, 5]))
    sched.add(request("c", [*PREFIX, 6, 7]))
    planned, _ = step(sched)
    assert planned.scheduled.num_scheduled_tokens == {"b": 3, "c": 2}


def test_an_identical_prompt_computes_its_last_block_again() -> None:
    sched = caching_scheduler()
    sched.add(request("a", PREFIX))
    drain(sched)
    sched.add(request("b", PREFIX))
    planned, outputs = step(sched)
    assert planned.scheduled.new_requests[0].num_computed_tokens == 12
    assert planned.scheduled.num_scheduled_tokens == {"b": 4}
    assert outputs[0].num_cached_tokens == 12


def test_a_prefix_shorter_than_a_block_is_not_shared() -> None:
    sched = caching_scheduler()
    sched.add(request("a", [1, 2, 3, 9, 9]))
    drain(sched)
    sched.add(request("b", [1, 2, 3, 8, 8]))
    planned, _ = step(sched)
    assert planned.scheduled.new_requests[0].num_computed_tokens == 0


def test_requests_running_together_share_blocks_and_report_cached_tokens() -> None:
    sched = caching_scheduler()
    sched.add(request("a", [*PREFIX, 1], max_tokens=8))
    _, first = step(sched)
    assert first[0].num_cached_tokens == 0
    sched.add(request("b", [*PREFIX, 2], max_tokens=8))
    _, outputs = step(sched)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["b"].num_cached_tokens == 16 and by_id["a"].num_cached_tokens is None  # only with the first token
    bm = sched.block_manager
    shared = bm.block_table("a")[:4]
    assert bm.block_table("b")[:4] == shared and all(bm.ref_count(b) == 2 for b in shared)
    sched.check_invariants()
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 16)
    assert stats.prefix_cache_hit_rate == 16 / 34
    sched.abort(["a"])
    assert all(bm.ref_count(b) == 1 for b in shared)
    drain(sched)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks > 0


def test_an_aborted_requests_computed_blocks_serve_the_next_request() -> None:
    sched = caching_scheduler(max_num_batched_tokens=8)
    sched.add(request("a", [*PREFIX, 1]))
    step(sched)
    step(sched)  # two chunks of 8: the prefix is computed
    sched.abort(["a"])
    sched.add(request("b", [*PREFIX, 5]))
    planned, _ = step(sched)
    assert planned.scheduled.new_requests[0].num_computed_tokens == 16


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    sched = caching_scheduler(num_blocks=10, max_num_seqs=2)
    sched.add(request("a", [30, 31, 32, 33, 34], max_tokens=20))
    sched.add(request("b", [*PREFIX, 1], max_tokens=12))
    outputs = []
    resumed = []
    while sched.has_unfinished():
        planned, out = step(sched)
        outputs += out
        resumed += [r for r in planned.scheduled.new_requests if r.token_ids[-1] == 7]  # sent again
        sched.check_invariants()
    assert sched.stats().num_preemptions > 0
    assert any(r.num_computed_tokens > 0 for r in resumed)
    assert sum(len(o.new_token_ids) for o in outputs) == 32


def test_reset_forgets_cached_prefixes() -> None:
    sched = caching_scheduler()
    sched.add(request("a", [*PREFIX, 1]))
    drain(sched)
    assert sched.reset_prefix_cache() == 5  # 17 prompt + 3 output tokens computed
    sched.add(request("b", [*PREFIX, 2]))
    planned, _ = step(sched)
    assert planned.scheduled.new_requests[0].num_computed_tokens == 0


def test_caching_off_computes_every_prompt_from_its_first_token() -> None:
    sched = caching_scheduler(enable_prefix_caching=False)
    sched.add(request("a", [*PREFIX, 1]))
    drain(sched)
    sched.add(request("b", [*PREFIX, 2]))
    planned, outputs = step(sched)
    assert planned.scheduled.num_scheduled_tokens == {"b": 17}
    assert outputs[0].num_cached_tokens is None
    assert not sched.stats().prefix_caching
