"""The scheduler under random workloads, against a simulated runner.

The runner plays the workers: it keeps only what the ``SchedulerOutput``s tell
it (token lists, block tables, computed counts) and the tokens it sampled
itself, writes each computed token into a simulated paged KV cache, and
samples by reading the whole context back through the block table. Its next
token is a fixed function of the token prefix, so every request's output
must equal what it would produce alone, however often it was chunked,
preempted or batched with others, and whether steps ran one at a time or
were planned one ahead (``depth`` 2: the next step is scheduled, and run,
before the previous one's output is postprocessed, as the engine core does).
Requests come from a few clients; a flooding client must never hold another
client's request behind its own.

With prefix caching on, prompts share prefixes of every length (shorter than
a block, whole blocks, the whole prompt). A KV slot holds the position and
the whole token prefix its values were computed from, so a request that
starts from cached blocks must read exactly what it would have computed
itself; and a block is never written while another request's table holds it.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.messages import FinishReason, RunnerOutput, SchedulerOutput
from trioserve.sampling_params import SamplingParams

VOCAB = 16
EOS = 0
MAX_DRAIN_STEPS = 5_000


def next_token(prefix: Sequence[int]) -> int:
    """The model: a deterministic function of the whole prefix."""
    return zlib.crc32(bytes(prefix)) % VOCAB


def solo_output(
    prompt: list[int], params: SamplingParams, eos_ids: Sequence[int], max_len: int
) -> tuple[list[int], FinishReason]:
    """What a request generates when it runs alone, start to end."""
    tokens, output = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token in eos_ids and not params.ignore_eos:
            return output, "stop"
        if token in params.stop_token_ids:
            return output, "stop"
        if len(output) >= params.max_tokens or len(tokens) >= max_len:
            return output, "length"


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class MirrorRunner:
    """The workers, simulated: state only from what the scheduler sends."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching
        # Each slot: the position and the token prefix (up to and including it) its values were computed from.
        self.kv: list[tuple[int, tuple[int, ...]] | None] = [None] * (num_blocks * block_size)
        self.requests: dict[str, _WorkerRequest] = {}
        self.num_cached_tokens = 0  # tokens new requests started with, computed by others

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._apply(out)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            self._compute(req_id, num_tokens)
        req_ids, token_ids = [], []
        for req_id in out.num_scheduled_tokens:
            req = self.requests[req_id]
            if req.num_computed_tokens == len(req.token_ids):
                context = [self._read(req_id, req, pos) for pos in range(len(req.token_ids))]
                req_ids.append(req_id)
                token_ids.append(next_token(context))
                req.token_ids.append(token_ids[-1])  # as the workers do
        return RunnerOutput(req_ids, token_ids)

    def _apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            assert req_id in self.requests, f"told to drop {req_id!r}, never held"
            del self.requests[req_id]
        for new in out.new_requests:
            assert new.req_id not in self.requests, f"{new.req_id!r} sent as new twice"
            if not self.caching:
                assert new.num_computed_tokens == 0, "no prefix caching: new requests start at 0"
            assert new.num_computed_tokens % self.block_size == 0, "a cached prefix is whole blocks"
            assert new.num_computed_tokens < len(new.token_ids), "at least one token is computed"
            self.num_cached_tokens += new.num_computed_tokens
            self.requests[new.req_id] = _WorkerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.cached_requests:
            req = self.requests[cached.req_id]
            assert cached.num_computed_tokens == req.num_computed_tokens, "computed count drifted"
            req.block_ids += cached.new_block_ids
        sent = [r.req_id for r in out.new_requests] + [r.req_id for r in out.cached_requests]
        assert len(sent) == len(set(sent)) and set(sent) == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

    def _compute(self, req_id: str, num_tokens: int) -> None:
        req = self.requests[req_id]
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_tokens
        assert num_tokens > 0 and end <= len(req.token_ids), "scheduled past the known tokens"
        assert len(req.block_ids) * self.block_size >= end, "block table too short"
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            block = req.block_ids[index]
            others = [r for r, other in self.requests.items() if r != req_id and block in other.block_ids]
            assert not others, f"{req_id!r} writes block {block}, which {others} hold"
        for pos in range(start, end):
            self.kv[self._slot(req, pos)] = (pos, tuple(req.token_ids[: pos + 1]))
        req.num_computed_tokens = end

    def _read(self, req_id: str, req: _WorkerRequest, pos: int) -> int:
        entry = self.kv[self._slot(req, pos)]
        assert entry == (pos, tuple(req.token_ids[: pos + 1])), f"KV of {req_id!r}@{pos} is {entry}"
        return entry[1][-1]

    def _slot(self, req: _WorkerRequest, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


class Harness:
    """A scheduler, its mirror runner, and everything the clients received."""

    def __init__(self, depth: int = 1, caching: bool = False, **sizes: int) -> None:
        self.depth = depth  # steps scheduled before the oldest is postprocessed
        self.in_flight: list[tuple[Step, RunnerOutput]] = []
        self.sched = Scheduler(**sizes, enable_prefix_caching=caching)
        self.sizes = sizes
        self.runner = MirrorRunner(sizes["num_blocks"], sizes["block_size"], caching)
        self.capacity = sizes["num_blocks"] * sizes["block_size"]
        self.max_len = min(sizes["max_model_len"], self.capacity + 1)
        self.expected: dict[str, tuple[list[int], FinishReason]] = {}
        self.received: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, FinishReason] = {}
        self.admitted: list[list[str]] = []  # each step's new (or resumed) requests, in admission order
        self.mid_step = False  # a step raised: the end-state checks would only add noise

    def live(self) -> list[str]:
        return sorted(r for r in self.received if r not in self.finish_reasons)

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, eos: list[int], client_id: str = "") -> bool:
        request = Request(req_id, prompt, params, eos, client_id)
        if len(prompt) >= self.sizes["max_model_len"] or len(prompt) > self.capacity:
            with pytest.raises(ValueError, match="prompt"):
                self.sched.add(request)
            return False
        self.sched.add(request)
        self.expected[req_id] = solo_output(prompt, params, eos, self.max_len)
        self.received[req_id] = []
        return True

    def abort(self, req_id: str) -> None:
        assert self.sched.abort([req_id]) == [req_id]
        self.finish_reasons[req_id] = "abort"

    def step(self) -> None:
        """As the engine core's step loop: schedule a step if fewer than
        ``depth`` are in flight, and run it at once (the workers run steps in
        order); then, if ``depth`` are in flight or nothing was scheduled,
        postprocess the oldest."""
        self.mid_step = True
        scheduled = False
        if len(self.in_flight) < self.depth and self.sched.has_unfinished():
            planned = self.sched.schedule()
            assert self.sched.num_running <= self.sizes["max_num_seqs"]
            if planned is not None:
                out = planned.scheduled
                assert out.total_num_scheduled_tokens <= self.sizes["max_num_batched_tokens"]
                assert out.total_num_scheduled_tokens or out.finished_req_ids, "a step with nothing to do"
                if self.in_flight:
                    assert planned.number == self.in_flight[-1][0].number + 1
                self.in_flight.append((planned, self.runner.execute(out)))
                self.admitted.append([r.req_id for r in out.new_requests])
                self._check_mirror(out)
                scheduled = True
        if self.in_flight and (len(self.in_flight) == self.depth or not scheduled):
            self._postprocess(*self.in_flight.pop(0))
        self.mid_step = False

    def _postprocess(self, planned: Step, runner_output: RunnerOutput) -> None:
        for output in self.sched.postprocess(planned, runner_output):
            req_id = output.request_id
            assert req_id not in self.finish_reasons, f"{req_id!r} got a token after finishing"
            self.received[req_id] += output.new_token_ids
            assert self.received[req_id] == self.expected[req_id][0][: len(self.received[req_id])]
            if output.finish_reason is not None:
                self.finish_reasons[req_id] = output.finish_reason

    def _check_mirror(self, out: SchedulerOutput) -> None:
        bm = self.sched.block_manager
        for req_id in out.num_scheduled_tokens:
            req, mirror = self.sched.get_request(req_id), self.runner.requests[req_id]
            # The workers hold the tokens the engine has, then those in flight.
            assert mirror.token_ids[: req.num_tokens] == req.all_token_ids, f"{req_id!r}: workers lost tokens"
            assert len(mirror.token_ids) == req.num_tokens + req.num_pending, f"{req_id!r}: pending drifted"
            assert mirror.block_ids == bm.block_table(req_id), f"{req_id!r}: block tables differ"
            assert mirror.num_computed_tokens == req.num_computed_tokens

    def drain_and_check(self) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished() and not self.in_flight:
                break
            self.step()
        else:
            raise AssertionError("the scheduler did not drain: livelock")
        last = self.sched.schedule()  # deliver the last finished ids
        if last is not None:
            assert last.num_tokens == 0
            self.runner.execute(last.scheduled)
        assert self.runner.requests == {}, "workers still hold requests"
        assert self.sched.block_manager.num_free_blocks == self.sched.block_manager.num_blocks
        for req_id, (tokens, reason) in self.expected.items():
            got = self.received[req_id]
            if self.finish_reasons[req_id] == "abort":
                assert got == tokens[: len(got)]
            else:
                assert (got, self.finish_reasons[req_id]) == (tokens, reason), req_id


CLIENTS = ["", "a", "b"]
requests = st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),  # prompt
    st.integers(1, 16),  # max_tokens
    st.booleans(),  # ignore_eos
    st.lists(st.integers(1, VOCAB - 1), max_size=1),  # stop_token_ids
)

# Two "system prompts": a prompt is a prefix of one of them (any length: none,
# shorter than a block, whole blocks, all of it) and a suffix of its own.
SHARED = [[(7 * i + 3) % VOCAB for i in range(24)], [(5 * i + 1) % VOCAB for i in range(24)]]


@st.composite
def shared_prefix_prompts(draw: st.DrawFn) -> list[int]:
    base = SHARED[draw(st.integers(0, len(SHARED) - 1))]
    prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    return prompt or [draw(st.integers(0, VOCAB - 1))]


shared_requests = st.tuples(shared_prefix_prompts(), st.integers(1, 16), st.booleans(), st.just([]))


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, aborts and steps; every request's tokens checked at the end."""

    harness: Harness

    @initialize(
        depth=st.sampled_from([1, 2]),
        caching=st.booleans(),
        num_blocks=st.integers(2, 16),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 12),
        max_model_len=st.integers(8, 40),
    )
    def setup(self, depth: int, caching: bool, **sizes: int) -> None:
        self.harness = Harness(depth, caching, **sizes)
        self.next_id = 0

    @rule(
        batch=st.lists(
            st.tuples(st.one_of(requests, shared_requests, shared_requests), st.sampled_from(CLIENTS)),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, batch) -> None:
        for (prompt, max_tokens, ignore_eos, stop_token_ids), client_id in batch:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
            added = self.harness.add(f"r{self.next_id}", prompt, params, [EOS], client_id)
            event("add: accepted" if added else "add: rejected (prompt)")
            self.next_id += 1

    @rule(pick=st.integers(0, 1_000))
    def abort(self, pick: int) -> None:
        live = self.harness.live()
        if live:
            self.harness.abort(live[pick % len(live)])

    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.harness.step()

    @rule()
    def reset_prefix_cache(self) -> None:
        self.harness.sched.reset_prefix_cache()
        assert self.harness.sched.block_manager.num_cached_blocks == 0

    @invariant()
    def scheduler_invariants_hold(self) -> None:
        self.harness.sched.check_invariants(step for step, _ in self.harness.in_flight)

    @invariant()
    def reference_counts_are_the_tables_holding_each_block(self) -> None:
        sched = self.harness.sched
        bm = sched.block_manager
        held = Counter(block for req in sched.running for block in bm.block_table(req.request_id))
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [held[b] for b in range(bm.num_blocks)]
        assert bm.num_free_blocks + len(held) == bm.num_blocks, "free + in use != all blocks"

    def teardown(self) -> None:
        if self.harness.mid_step:
            return
        self.harness.drain_and_check()
        preemptions = self.harness.sched.stats().num_preemptions
        target(float(preemptions), label="preemptions")
        target(float(self.harness.runner.num_cached_tokens), label="tokens from the prefix cache")
        event("prefix cache hit" if self.harness.runner.num_cached_tokens else "no prefix cache hit")
        event("preempted" if preemptions else "no preemption")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_heavy_workload_preempts_and_still_matches_solo_outputs(seed: int, depth: int) -> None:
    rng = random.Random(seed)
    harness = Harness(depth, num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    for i in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        params = SamplingParams(max_tokens=rng.randint(4, 10), ignore_eos=True)
        assert harness.add(f"r{i}", prompt, params, [EOS])
        if i % 3 == 2:
            harness.step()
            harness.sched.check_invariants(step for step, _ in harness.in_flight)
    harness.drain_and_check()
    assert harness.sched.stats().num_preemptions > 0


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_shared_prefixes_under_preemption_still_match_solo_outputs(seed: int, depth: int) -> None:
    rng = random.Random(seed)
    sizes = dict(num_blocks=16, block_size=2, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40)
    harness = Harness(depth, True, **sizes)
    for i in range(16):
        base = SHARED[i % 2]
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        params = SamplingParams(max_tokens=rng.randint(2, 8), ignore_eos=True)
        assert harness.add(f"r{i}", prompt or [1], params, [EOS])
        if i % 2:
            harness.step()
            harness.sched.check_invariants(step for step, _ in harness.in_flight)
    harness.drain_and_check()
    stats = harness.sched.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert harness.runner.num_cached_tokens >= stats.prefix_cache_hits


@settings(max_examples=150, deadline=None)
@given(
    depth=st.sampled_from([1, 2]),
    num_blocks=st.integers(2, 10),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 12),
    max_model_len=st.integers(8, 40),
    flood=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=40),
    polite=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    warmup=st.integers(0, 20),
)
def test_a_flood_of_one_client_never_holds_another_clients_request_behind_it(
    depth: int, flood: list[list[int]], polite: list[int], warmup: int, **sizes: int
) -> None:
    """Once a polite client's request waits, at most one request of the
    flooding client (whose turn may come first) is admitted before it, and it
    is admitted within a number of steps that does not grow with the flood."""
    harness = Harness(depth, **sizes)
    long = SamplingParams(max_tokens=sizes["max_model_len"], ignore_eos=True)
    for i, prompt in enumerate(flood):
        harness.add(f"flood{i}", prompt, long, [EOS], "flood")
    for _ in range(warmup):
        harness.step()
    if not harness.add("polite", polite, SamplingParams(max_tokens=2), [EOS], "polite"):
        return
    max_steps = depth * (sizes["max_num_seqs"] + 1) * (harness.max_len + 1)
    before = len(harness.admitted)
    for num_steps in range(1, max_steps + 1):
        harness.step()
        admitted = [req_id for ids in harness.admitted[before:] for req_id in ids]
        if "polite" in admitted:
            admitted = admitted[: admitted.index("polite")]
        assert len(admitted) <= 1, f"flood requests admitted while polite waited: {admitted}"
        if harness.sched.get_request("polite") is None or harness.runner.requests.get("polite"):
            event("polite admitted within 3 steps" if num_steps <= 3 else "polite admitted after more steps")
            break
    else:
        raise AssertionError(f"polite not admitted within {max_steps} steps")
    harness.drain_and_check()
