"""The scheduler: admission, chunked prefill, preemption, stops, aborts, outputs."""

from __future__ import annotations

import msgspec
import pytest
from helpers.scheduling import EOS, make_request, make_scheduler

from trioserve.core.request import Request, RequestStatus
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.messages import RunnerOutput, SampleLogprobs, SchedulerOutput, TokenOutput
from trioserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _outputs_without_queue_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare outputs whole; a first token's queue time is a clock reading, checked on its own
    (``test_the_first_token_carries_how_long_its_request_waited``)."""
    postprocess = Scheduler.postprocess

    def without_queue_times(self: Scheduler, *args: object, **kwargs: object) -> list[TokenOutput]:
        return [msgspec.structs.replace(out, queued_s=None) for out in postprocess(self, *args, **kwargs)]  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "postprocess", without_queue_times)


def test_the_first_token_carries_how_long_its_request_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real postprocess
    sched = make_scheduler()
    sched.add(make_request("a", 3, max_tokens=3))
    queued = []
    for token in (42, 43):
        step = sched.schedule()
        assert step is not None
        (out,) = sched.postprocess(step, RunnerOutput(["a"], [token]))
        queued.append(out.queued_s)
    assert queued[0] is not None and 0 <= queued[0] < 5 and queued[1] is None


def samplers(sched: Scheduler, out: SchedulerOutput) -> list[str]:
    """The scheduled requests whose slice reached the end of their tokens."""
    result = []
    for req_id in out.num_scheduled_tokens:
        req = sched.get_request(req_id)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            result.append(req_id)
    return result


NOTHING = SchedulerOutput([], [], {}, 0, [])


def step(sched: Scheduler, token: int | dict[str, int] = 7) -> tuple[SchedulerOutput, list[TokenOutput]]:
    """One schedule -> run -> postprocess round; every sampler gets ``token``.
    A round with nothing to do gives an empty ``SchedulerOutput``."""
    planned = sched.schedule()
    if planned is None:
        return NOTHING, []
    out = planned.scheduled
    req_ids = samplers(sched, out)
    tokens = [token if isinstance(token, int) else token[r] for r in req_ids]
    return out, sched.postprocess(planned, RunnerOutput(req_ids, tokens))


def schedule(sched: Scheduler) -> Step:
    """The next step, which the test expects there to be."""
    planned = sched.schedule()
    assert planned is not None
    return planned


class StepLoop:
    """The engine core's step loop over ``sched``: up to ``depth`` steps in
    flight, each run at once; every sampler gets token 7."""

    def __init__(self, sched: Scheduler, depth: int) -> None:
        self.sched, self.depth = sched, depth
        self.in_flight: list[Step] = []

    def turn(self) -> SchedulerOutput:
        """Plan a step if fewer than ``depth`` are in flight; then postprocess
        the oldest if ``depth`` are, or if none was planned. Returns what was planned."""
        planned = self.sched.schedule() if len(self.in_flight) < self.depth else None
        if planned is not None:
            self.in_flight.append(planned)
        if self.in_flight and (len(self.in_flight) == self.depth or planned is None):
            oldest = self.in_flight.pop(0)
            req_ids = [r.request_id for r in oldest.samplers]
            self.sched.postprocess(oldest, RunnerOutput(req_ids, [7] * len(req_ids)))
        self.sched.check_invariants(self.in_flight)
        return NOTHING if planned is None else planned.scheduled

    def until_admitted(self, req_id: str, max_turns: int) -> int:
        """Turns until ``req_id`` is first scheduled (it must be within ``max_turns``)."""
        for turn in range(1, max_turns + 1):
            if req_id in new_ids(self.turn()):
                return turn
        raise AssertionError(f"{req_id!r} not admitted within {max_turns} turns")


def running_by_client(sched: Scheduler) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for req in sched.running:
        result.setdefault(req.client_id, []).append(req.request_id)
    return result


def new_ids(out: SchedulerOutput) -> list[str]:
    return [r.req_id for r in out.new_requests]


def cached_ids(out: SchedulerOutput) -> list[str]:
    return [r.req_id for r in out.cached_requests]


# --- add -----------------------------------------------------------------------


def test_add_rejects_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt"):
        make_scheduler().add(make_request("a", prompt_len=0))


def test_add_rejects_prompt_longer_than_context() -> None:
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="prompt"):
        sched.add(make_request("a", prompt_len=8))
    sched.add(make_request("b", prompt_len=7, max_tokens=1))


def test_add_rejects_prompt_larger_than_the_whole_kv_cache() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        sched.add(make_request("a", prompt_len=9))


def test_add_accepts_a_prompt_that_fills_the_whole_kv_cache() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_request("a", prompt_len=8))
    _, outputs = step(sched)
    assert outputs[0].finish_reason == "length"  # a 9th token could never be computed


def test_add_rejects_negative_token_ids() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="prompt"):
        sched.add(Request("a", [1, -1], SamplingParams(), eos_token_ids=[EOS]))


def test_add_rejects_duplicate_request_id() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    with pytest.raises(ValueError, match="request_id"):
        sched.add(make_request("a"))


def test_request_id_can_be_reused_after_it_finishes() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=1))
    step(sched)
    assert not sched.has_unfinished()
    sched.add(make_request("a", max_tokens=1))
    out, _ = step(sched)
    assert out.finished_req_ids == ["a"] and new_ids(out) == ["a"]


def test_get_request_and_has_unfinished_see_only_unfinished_requests() -> None:
    sched = make_scheduler()
    assert not sched.has_unfinished()
    req = make_request("a", max_tokens=1)
    sched.add(req)
    assert sched.get_request("a") is req and sched.has_unfinished()
    step(sched)
    assert sched.get_request("a") is None and not sched.has_unfinished()
    assert req.status is RequestStatus.FINISHED


# --- prefill and decode ----------------------------------------------------------


def test_short_prompt_is_prefilled_in_one_step_and_samples() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=5))
    out, outputs = step(sched, token=42)
    (new,) = out.new_requests
    assert new.token_ids == [10, 11, 12, 13, 14]
    assert new.num_computed_tokens == 0
    assert len(new.block_ids) == 2
    assert out.num_scheduled_tokens == {"a": 5} and out.total_num_scheduled_tokens == 5
    assert outputs == [TokenOutput("a", [42])]
    assert sched.get_request("a").num_computed_tokens == 5


def test_decode_sends_only_new_blocks_the_workers_append_what_they_sample() -> None:
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", prompt_len=3))
    step(sched, token=42)
    out, _ = step(sched, token=43)
    assert out.new_requests == []
    (cached,) = out.cached_requests
    assert cached.new_block_ids == []  # 4 tokens still fit in the first block
    assert cached.num_computed_tokens == 3
    assert out.num_scheduled_tokens == {"a": 1}
    out, _ = step(sched)
    assert len(out.cached_requests[0].new_block_ids) == 1  # the 5th token opens a block
    assert sched.get_request("a").output_token_ids == [42, 43, 7]


def test_long_prompt_is_prefilled_in_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_request("a", prompt_len=10))
    out1, outputs1 = step(sched)
    out2, outputs2 = step(sched)
    out3, outputs3 = step(sched, token=42)
    assert [o.num_scheduled_tokens["a"] for o in (out1, out2, out3)] == [4, 4, 2]
    assert new_ids(out1) == ["a"] and out1.new_requests[0].token_ids == list(range(10, 20))
    assert [c.num_computed_tokens for c in out2.cached_requests + out3.cached_requests] == [4, 8]
    assert outputs1 == outputs2 == []  # mid-prefill chunks sample nothing
    assert outputs3 == [TokenOutput("a", [42])]


def test_token_budget_goes_to_running_requests_before_new_ones() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add(make_request("a", prompt_len=5))
    step(sched)
    sched.add(make_request("b", prompt_len=8))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert out.total_num_scheduled_tokens == 6


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for req_id in "abc":
        sched.add(make_request(req_id))
    out, _ = step(sched)
    assert new_ids(out) == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)


def test_waiting_queue_is_fifo_without_skipping_ahead() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add(make_request("a", prompt_len=8))
    sched.add(make_request("big", prompt_len=12, max_tokens=1))
    sched.add(make_request("small", prompt_len=2))
    out, _ = step(sched)
    # "big" needs 3 blocks and only 2 are free; "small" would fit but must wait its turn.
    assert new_ids(out) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


# --- fairness across clients ----------------------------------------------------------


def test_waiting_requests_are_admitted_in_rotation_across_clients() -> None:
    sched = make_scheduler(max_num_seqs=8)
    for req_id in ("a1", "a2", "a3", "b1", "b2", "c1"):
        sched.add(make_request(req_id, client_id=req_id[0]))
    out, _ = step(sched)
    assert new_ids(out) == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_rotation_gives_the_next_free_slot_to_the_next_client() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for req_id in ("a1", "a2", "b1", "c1"):
        sched.add(make_request(req_id, client_id=req_id[0], max_tokens=1))
    admitted = [new_ids(step(sched)[0]) for _ in range(4)]
    assert admitted == [["a1"], ["b1"], ["c1"], ["a2"]]


def test_a_clients_requests_keep_their_order_among_themselves() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add(make_request("a", prompt_len=8, client_id="x"))
    sched.add(make_request("big", prompt_len=12, client_id="x", max_tokens=1))
    sched.add(make_request("small", prompt_len=2, client_id="x"))
    out, _ = step(sched)
    assert new_ids(out) == ["a"]  # "big" does not fit, and "small" of the same client waits behind it
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_flood_of_one_client_does_not_delay_another_clients_request_once_a_slot_is_free(depth: int) -> None:
    sched = make_scheduler(max_num_seqs=1)
    for i in range(20):
        sched.add(make_request(f"flood{i}", client_id="flood", max_tokens=3))
    loop = StepLoop(sched, depth)
    loop.turn()
    sched.add(make_request("polite", client_id="polite", max_tokens=1))
    # flood0 holds the only slot (it is nobody's to take): polite gets it in the first step planned after
    # flood0's last token is back (two more turns of flood0, one more with a step in flight).
    assert loop.until_admitted("polite", max_turns=10) == 2 + depth
    assert [r.request_id for r in sched.waiting] == [f"flood{i}" for i in range(1, 20)]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_flood_of_one_client_does_not_delay_another_clients_request_once_blocks_are_free(depth: int) -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=4)
    for i in range(20):
        sched.add(make_request(f"flood{i}", prompt_len=5, client_id="flood", max_tokens=3))
    loop = StepLoop(sched, depth)
    loop.turn()  # flood0 holds both blocks (and is nobody's to take)
    sched.add(make_request("polite", prompt_len=4, client_id="polite", max_tokens=1))
    assert loop.until_admitted("polite", max_turns=10) == 2 + depth
    assert sched.get_request("flood1").status is RequestStatus.WAITING  # it came first, yet waits its turn


@pytest.mark.parametrize("depth", [1, 2])
def test_a_starved_client_gets_a_slot_by_a_fairness_preemption_within_one_step(depth: int) -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(8):
        sched.add(make_request(f"f{i}", client_id="flood", max_tokens=50))
    loop = StepLoop(sched, depth)
    assert new_ids(loop.turn()) == ["f0", "f1", "f2", "f3"]
    sched.add(make_request("p", client_id="polite", max_tokens=50))
    out = loop.turn()
    assert new_ids(out) == ["p"]
    assert out.finished_req_ids == ["f3"]  # the flood's newest makes room
    assert running_by_client(sched) == {"flood": ["f0", "f1", "f2"], "polite": ["p"]}
    assert [r.request_id for r in sched.waiting][:2] == ["f3", "f4"]  # f3 resumes first among the flood's
    stats = sched.stats()
    assert (stats.num_fairness_preemptions, stats.num_preemptions) == (1, 0)


def test_a_starved_client_gets_kv_blocks_by_a_fairness_preemption() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    for i in range(4):
        sched.add(make_request(f"f{i}", prompt_len=3, client_id="flood", max_tokens=50))
    step(sched)  # one block each: the cache is full
    sched.add(make_request("p", prompt_len=4, client_id="polite", max_tokens=50))
    out, _ = step(sched)
    assert new_ids(out) == ["p"] and out.finished_req_ids == ["f3"]
    assert out.num_scheduled_tokens == {"f0": 1, "f1": 1, "f2": 1, "p": 4}
    assert sched.stats().num_fairness_preemptions == 1


def test_a_starved_clients_request_is_prefilled_before_others_later_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(3):
        sched.add(make_request(f"f{i}", prompt_len=40, client_id="flood", max_tokens=50))
    step(sched)  # f0 takes the whole budget
    sched.add(make_request("p", prompt_len=4, client_id="polite", max_tokens=1))
    out, _ = step(sched)
    # f0 comes first (nothing sorts before a client's oldest); p takes its place before the flood's younger ones.
    assert out.num_scheduled_tokens == {"f0": 8} and new_ids(out) == []
    sched.abort(["f0"])
    out, outputs = step(sched)
    assert new_ids(out) == ["p", "f1"] and out.num_scheduled_tokens == {"p": 4, "f1": 4}
    assert [o.request_id for o in outputs] == ["p"]


def test_fairness_preemptions_do_not_go_back_and_forth() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(6):
        sched.add(make_request(f"a{i}", client_id="a", max_tokens=20))
    step(sched)
    for i in range(6):
        sched.add(make_request(f"b{i}", client_id="b", max_tokens=20))
    out, _ = step(sched)
    assert new_ids(out) == ["b0", "b1"] and out.finished_req_ids == ["a3", "a2"]
    for _ in range(10):
        out, _ = step(sched)
        assert out.new_requests == [] and out.finished_req_ids == []
    assert running_by_client(sched) == {"a": ["a0", "a1"], "b": ["b0", "b1"]}
    assert sched.stats().num_fairness_preemptions == 2


def test_a_client_within_one_of_another_takes_nothing_from_it() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for i in range(4):
        sched.add(make_request(f"a{i}", client_id="a", max_tokens=20))
    step(sched)
    sched.add(make_request("b0", client_id="b", max_tokens=20))
    step(sched)  # b0 takes a2's slot: a holds 2, b 1
    sched.add(make_request("b1", client_id="b", max_tokens=20))
    for _ in range(5):
        out, _ = step(sched)
        assert out.new_requests == [] and out.finished_req_ids == []
    assert sched.stats().num_fairness_preemptions == 1


# --- decodes before prefill chunks ------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_decodes_are_scheduled_before_prefill_chunks(depth: int) -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_request("f0", prompt_len=2, client_id="flood", max_tokens=2))
    sched.add(make_request("f1", prompt_len=60, client_id="flood", max_tokens=1))
    loop = StepLoop(sched, depth)
    loop.turn()
    sched.add(make_request("p", prompt_len=2, client_id="polite", max_tokens=20))
    assert loop.turn().num_scheduled_tokens == {"f0": 1, "p": 2, "f1": 5}  # p outranks f1: it goes first
    for _ in range(4):
        out = loop.turn()  # f0 is done: f1, admitted before p, now comes first in running order
        assert [r.request_id for r in sched.running] == ["f1", "p"]
        assert out.num_scheduled_tokens == {"p": 1, "f1": 7}


def test_a_request_preempted_for_blocks_loses_the_decode_it_got_in_that_step() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=8)
    sched.add(make_request("f0", prompt_len=2, client_id="flood", max_tokens=2))
    sched.add(make_request("f1", prompt_len=19, client_id="flood", max_tokens=1))
    step(sched)  # f0: 2 tokens, f1: 6 (2 blocks)
    sched.add(make_request("p", prompt_len=3, client_id="polite", max_tokens=20))
    step(sched)  # f0's last token; p admitted before f1's chunk of 4 (p: 1 block, f1: 3)
    out, _ = step(sched)  # f0 is done: [f1, p]. p decodes; f1's chunk of 7 needs 2 more blocks, 1 is free
    assert out.num_scheduled_tokens == {"f1": 7}
    assert out.finished_req_ids == ["f0", "p"]
    assert sched.get_request("p").status is RequestStatus.WAITING
    sched.check_invariants()


# --- preemption --------------------------------------------------------------------


def test_newest_request_is_preempted_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("old", prompt_len=4, max_tokens=4))
    sched.add(make_request("new", prompt_len=4, max_tokens=4))
    step(sched)  # 4 blocks in use, each request has 5 tokens: both need a 3rd block
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"old": 1}
    assert out.finished_req_ids == ["new"]
    preempted = sched.get_request("new")
    assert preempted.status is RequestStatus.WAITING
    assert preempted.num_computed_tokens == 0
    assert sched.block_manager.block_table("new") == []
    assert list(sched.waiting) == [preempted]
    assert sched.stats().num_preemptions == 1


def test_request_preempts_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=4)
    sched.add(make_request("old", prompt_len=2, max_tokens=3))
    sched.add(make_request("new", prompt_len=4, max_tokens=1))
    out, _ = step(sched)  # old: 2 tokens (1 block); new: 2 of its 4 tokens (1 block)
    assert out.num_scheduled_tokens == {"old": 2, "new": 2}
    # old takes the last free block; new's next chunk needs one more, and new
    # is the newest running request: it preempts itself.
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"old": 1}
    assert out.finished_req_ids == ["new"]
    new = sched.get_request("new")
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0


def test_preemption_takes_the_newest_first_and_keeps_their_order() -> None:
    sched = make_scheduler(num_blocks=3, block_size=1)
    for req_id in "abc":
        sched.add(make_request(req_id, prompt_len=1, max_tokens=2))
    step(sched)  # each holds 1 block and now has 2 tokens
    out, _ = step(sched)  # a preempts c; then b finds no block and is the newest
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == ["c", "b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.stats().num_preemptions == 2


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=3)
    sched.add(make_request("old", prompt_len=4, max_tokens=2))
    sched.add(make_request("new", prompt_len=3, max_tokens=4))
    step(sched)
    sched.add(make_request("tiny", prompt_len=1))
    out, _ = step(sched)  # "old" preempts "new" and finishes: blocks are free, yet no admission
    assert out.finished_req_ids == ["new"]
    assert out.new_requests == []
    assert [r.request_id for r in sched.waiting] == ["new", "tiny"]
    out, _ = step(sched)
    assert new_ids(out) == ["new", "tiny"]  # the preempted request goes first


def test_preempted_request_is_resent_with_all_tokens() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("old", prompt_len=4, max_tokens=2))
    sched.add(make_request("new", prompt_len=4, max_tokens=4))
    step(sched, token=50)
    out, outputs = step(sched, token=51)  # "new" is preempted; "old" finishes (max_tokens=2)
    assert out.finished_req_ids == ["new"]
    assert outputs == [TokenOutput("old", [51], "length")]
    out, _ = step(sched)
    (resent,) = out.new_requests
    assert resent.req_id == "new"
    assert resent.token_ids == [10, 11, 12, 13, 50]
    assert resent.num_computed_tokens == 0
    assert resent.block_ids == sched.block_manager.block_table("new")
    assert len(resent.block_ids) == 3
    assert out.num_scheduled_tokens == {"new": 5}


def test_preempted_request_output_continues_where_it_stopped() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("old", prompt_len=4, max_tokens=2))
    sched.add(make_request("new", prompt_len=4, max_tokens=2))
    step(sched, token=50)
    step(sched, token=51)  # "new" preempted, "old" finished
    _, outputs = step(sched, token=52)
    assert outputs == [TokenOutput("new", [52], "length")]
    assert sched.block_manager.num_free_blocks == 4


# --- stops ---------------------------------------------------------------------------


def test_eos_stops_the_request() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    _, outputs = step(sched, token=EOS)
    assert outputs == [TokenOutput("a", [EOS], "stop")]


def test_ignore_eos_keeps_generating() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", ignore_eos=True, max_tokens=2))
    _, first = step(sched, token=EOS)
    _, second = step(sched, token=EOS)
    assert first == [TokenOutput("a", [EOS])]
    assert second == [TokenOutput("a", [EOS], "length")]


def test_stop_token_id_stops_the_request() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", stop_token_ids=[9]))
    _, outputs = step(sched, token=9)
    assert outputs[0].finish_reason == "stop"


def test_eos_wins_over_max_tokens_on_the_last_token() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=1))
    _, outputs = step(sched, token=EOS)
    assert outputs[0].finish_reason == "stop"


def test_max_tokens_stops_with_length() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=3))
    reasons = [step(sched)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"]


def test_context_length_stops_with_length() -> None:
    sched = make_scheduler(max_model_len=6)
    sched.add(make_request("a", prompt_len=4, max_tokens=100))
    reasons = [step(sched)[1][0].finish_reason for _ in range(2)]
    assert reasons == [None, "length"]


def test_request_stops_with_length_when_it_would_outgrow_the_whole_kv_cache() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    sched.add(make_request("a", prompt_len=4, max_tokens=100))
    reasons = [step(sched)[1][0].finish_reason for _ in range(5)]
    # 4 + 5 tokens: the first 8 fill the cache, the 9th is sampled but never computed.
    assert reasons == [None, None, None, None, "length"]
    assert not sched.has_unfinished()


def test_finished_request_frees_its_blocks_at_once() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=9, max_tokens=1))
    step(sched)
    assert sched.block_manager.num_free_blocks == 16
    assert sched.num_running == 0


def test_finished_request_is_named_once_in_the_next_output() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=1))
    sched.add(make_request("b", max_tokens=3))
    step(sched)
    out, _ = step(sched)
    assert out.finished_req_ids == ["a"]
    out, _ = step(sched)
    assert out.finished_req_ids == []


def test_logprobs_are_passed_through() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    sched.add(make_request("b"))
    out = schedule(sched)
    lp = SampleLogprobs(-0.5, [7, 8], [-0.5, -1.5])
    outputs = sched.postprocess(out, RunnerOutput(["a", "b"], [7, 8], [lp, None]))
    assert outputs == [TokenOutput("a", [7], None, [lp]), TokenOutput("b", [8])]


def test_postprocess_raises_if_the_runner_skips_a_sampling_request() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    out = schedule(sched)
    with pytest.raises(RuntimeError, match="'a'"):
        sched.postprocess(out, RunnerOutput([], []))


# --- abort ---------------------------------------------------------------------------


def test_abort_frees_blocks_of_running_request() -> None:
    sched = make_scheduler()
    req = make_request("a", prompt_len=9)
    sched.add(req)
    step(sched)
    assert sched.block_manager.num_free_blocks < 16
    assert sched.abort(["a"]) == ["a"]
    assert sched.block_manager.num_free_blocks == 16
    assert req.status is RequestStatus.FINISHED and req.finish_reason == "abort"
    assert sched.num_running == 0 and not sched.has_unfinished()
    out, _ = step(sched)
    assert out.finished_req_ids == ["a"]


def test_abort_removes_a_waiting_request_the_workers_never_saw() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    assert sched.abort(["a"]) == ["a"]
    out, _ = step(sched)
    assert sched.num_waiting == 0
    assert out.finished_req_ids == [] and out.total_num_scheduled_tokens == 0


def test_abort_of_a_preempted_request_names_it_only_once() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("old", prompt_len=4, max_tokens=4))
    sched.add(make_request("new", prompt_len=4, max_tokens=4))
    step(sched)
    out, _ = step(sched)
    assert out.finished_req_ids == ["new"]
    assert sched.abort(["new"]) == ["new"]
    out, _ = step(sched)
    assert out.finished_req_ids == []


def test_abort_ignores_unknown_finished_and_repeated_ids() -> None:
    sched = make_scheduler()
    sched.add(make_request("done", max_tokens=1))
    sched.add(make_request("live"))
    step(sched)
    assert sched.abort(["nope", "done", "live", "live"]) == ["live"]


def test_abort_rejects_a_bare_string() -> None:
    with pytest.raises(TypeError):
        make_scheduler().abort("abc")


def test_token_of_a_request_aborted_mid_step_is_dropped() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    sched.add(make_request("b"))
    out = schedule(sched)
    sched.abort(["a"])
    outputs = sched.postprocess(out, RunnerOutput(["a", "b"], [7, 8]))
    assert outputs == [TokenOutput("b", [8])]


# --- empty steps and stats -------------------------------------------------------------


def test_empty_schedule_still_carries_finished_ids() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=1))
    step(sched)
    assert schedule(sched).scheduled == SchedulerOutput([], [], {}, 0, ["a"])
    assert sched.schedule() is None  # nothing for the workers: no step


def test_stats_count_every_step_made_and_preemptions() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("old", prompt_len=4, max_tokens=2))
    sched.add(make_request("new", prompt_len=4, max_tokens=2))
    sched.add(make_request("queued", prompt_len=4, max_tokens=1))
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (2, 1, 0)
    while sched.has_unfinished():
        step(sched)
    assert schedule(sched).scheduled == SchedulerOutput([], [], {}, 0, ["queued"])  # a step with no tokens
    assert sched.schedule() is None  # nothing to do: not a step
    stats = sched.stats()
    assert stats.num_preemptions == 1
    assert stats.num_total_blocks == stats.num_free_blocks == 4
    assert stats.num_steps == 5
    sched.check_invariants()


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_model_len", 1), ("num_blocks", 0)],
)
def test_constructor_rejects_bad_sizes(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        make_scheduler(**{name: value})


# --- steps planned ahead (the engine core keeps two in flight) ---------------


def test_a_step_planned_ahead_computes_the_token_still_in_flight() -> None:
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", prompt_len=3, max_tokens=10))
    first = schedule(sched)  # prefill: samples token 4
    second = schedule(sched)  # planned before the first returns: computes token 4
    assert first.scheduled.num_scheduled_tokens == {"a": 3} and second.scheduled.num_scheduled_tokens == {"a": 1}
    (cached,) = second.scheduled.cached_requests
    assert cached.num_computed_tokens == 3 and cached.new_block_ids == []
    assert sched.get_request("a").num_pending == 2
    sched.check_invariants([first, second])
    assert sched.postprocess(first, RunnerOutput(["a"], [42])) == [TokenOutput("a", [42])]
    third = schedule(sched)
    assert third.scheduled.num_scheduled_tokens == {"a": 1}
    assert len(third.scheduled.cached_requests[0].new_block_ids) == 1
    assert sched.postprocess(second, RunnerOutput(["a"], [43])) == [TokenOutput("a", [43])]
    assert sched.postprocess(third, RunnerOutput(["a"], [44])) == [TokenOutput("a", [44])]
    assert sched.get_request("a").output_token_ids == [42, 43, 44]
    assert sched.get_request("a").num_pending == 0
    sched.check_invariants()


def test_the_token_planned_after_a_stop_is_dropped_and_its_blocks_are_free() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=4, max_tokens=10))
    first, second = schedule(sched), schedule(sched)
    assert sched.postprocess(first, RunnerOutput(["a"], [EOS])) == [TokenOutput("a", [EOS], "stop")]
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()
    assert sched.postprocess(second, RunnerOutput(["a"], [7])) == []  # computed, then dropped
    assert schedule(sched).scheduled.finished_req_ids == ["a"]
    sched.check_invariants()


def test_a_request_is_not_planned_past_its_max_tokens() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=4, max_tokens=1))
    sched.add(make_request("b", prompt_len=4, max_tokens=2))
    first, second = schedule(sched), schedule(sched)
    assert second.scheduled.num_scheduled_tokens == {"b": 1}  # a's token in flight is its last
    outputs = sched.postprocess(first, RunnerOutput(["a", "b"], [5, 6]))
    assert outputs == [TokenOutput("a", [5], "length"), TokenOutput("b", [6])]
    third = schedule(sched)  # b's token in flight is its last: only "forget a" is left to do
    assert third.scheduled.num_scheduled_tokens == {} and third.scheduled.finished_req_ids == ["a"]
    assert sched.postprocess(second, RunnerOutput(["b"], [7])) == [TokenOutput("b", [7], "length")]
    assert sched.postprocess(third, RunnerOutput([], [])) == []


def test_steps_are_numbered_in_the_order_they_are_made() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=10))
    first, second = schedule(sched), schedule(sched)
    assert (first.number, second.number) == (1, 2)
    assert first.samplers == second.samplers == (sched.get_request("a"),)
    sched.postprocess(first, RunnerOutput(["a"], [5]))
    assert schedule(sched).number == 3 and sched.stats().num_steps == 3


def test_a_request_preempted_while_a_step_samples_for_it_keeps_that_token() -> None:
    sched = make_scheduler(num_blocks=2, block_size=2, max_num_batched_tokens=8)
    sched.add(make_request("old", prompt_len=2, max_tokens=4))
    sched.add(make_request("new", prompt_len=1, max_tokens=4))
    first = schedule(sched)  # both prefill, a block each; both sample
    second = schedule(sched)  # "old" needs a second block: "new" is preempted
    assert second.scheduled.num_scheduled_tokens == {"old": 1}
    assert second.scheduled.finished_req_ids == ["new"]
    new = sched.get_request("new")
    assert new.status is RequestStatus.WAITING and new.num_pending == 1
    sched.check_invariants([first, second])
    outputs = sched.postprocess(first, RunnerOutput(["old", "new"], [5, 6]))
    assert outputs == [TokenOutput("old", [5]), TokenOutput("new", [6])]
    assert new.output_token_ids == [6] and new.num_pending == 0
    assert sched.postprocess(second, RunnerOutput(["old"], [7])) == [TokenOutput("old", [7])]
    sched.check_invariants()


def test_a_token_in_flight_for_an_aborted_request_never_reaches_a_new_one_with_its_id() -> None:
    sched = make_scheduler()
    sched.add(make_request("x", prompt_len=3, max_tokens=10))
    first = schedule(sched)  # samples for the old "x"
    sched.abort(["x"])
    sched.add(make_request("x", prompt_len=4, max_tokens=10))  # the id is free again
    second = schedule(sched)
    assert second.scheduled.finished_req_ids == ["x"] and [r.req_id for r in second.scheduled.new_requests] == ["x"]
    assert sched.postprocess(first, RunnerOutput(["x"], [99])) == []  # the old request's token
    assert sched.get_request("x").output_token_ids == []
    sched.check_invariants([second])
    assert sched.postprocess(second, RunnerOutput(["x"], [5])) == [TokenOutput("x", [5])]
