"""The engine core's step loop, against an in-memory executor on Trio's
virtual clock: the order of its stages with one and with two steps in flight.

``VirtualWorkers`` stands for the workers: each step takes ``STEP_S`` of
virtual time and steps run one after another, so a step starts when it is
dispatched or when the step before it is done, whichever is later. Its
tokens come from the fake runner's code, run in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from helpers.fakes import EOS, VOCAB, QuietFakeRunner, fake_tokens

from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.messages import AddRequest, EngineInfo, EngineOutputs, EngineResponse, ModelInfo, RunnerOutput
from trioserve.nurseries.engine_core.step_loop import EngineCore

STEP_S = 1.0
INFO = EngineInfo(
    model=ModelInfo(vocab_size=VOCAB, max_model_len=256, eos_token_ids=[EOS]),
    num_kv_blocks=64, block_size=4, max_model_len=256, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class VirtualWorkers:
    """The executor's face (``config``, ``engine_index``, ``dispatch``,
    ``collect``) over a fake runner whose steps take ``STEP_S`` each, back to back."""

    engine_index = 0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = QuietFakeRunner(config)
        self.events: list[tuple[str, int, float]] = []  # (what, step number, when)
        self._free_at = 0.0
        self._outputs: dict[int, tuple[float, RunnerOutput]] = {}

    async def dispatch(self, step: Step) -> None:
        now = trio.current_time()
        self._free_at = max(now, self._free_at) + STEP_S
        self._outputs[step.number] = (self._free_at, self.runner.execute(step.scheduled))
        self.events.append(("dispatch", step.number, now))
        await trio.lowlevel.checkpoint()

    async def collect(self, step: Step) -> RunnerOutput:
        done_at, output = self._outputs.pop(step.number)
        await trio.sleep_until(done_at)
        self.events.append(("collect", step.number, trio.current_time()))
        return output


class RecordingOutbox:
    """The outbox as the step loop sees it; notes each batch of token outputs
    in the workers' event list, so that the order of stages shows there."""

    def __init__(self, channel: trio.MemorySendChannel[EngineResponse], events: list[tuple[str, int, float]]) -> None:
        self._channel = channel
        self._events = events

    async def send(self, msg: EngineResponse) -> None:
        if isinstance(msg, EngineOutputs):
            self._events.append(("outputs", 0, trio.current_time()))
        await self._channel.send(msg)


async def run_loop(depth: int, requests: list[AddRequest]) -> tuple[VirtualWorkers, list[tuple[float, Any]]]:
    """Feed ``requests`` to a step loop at time 0 and run it until every one
    finished; the workers' events and what reached the outbox, with times."""
    fake = FakeRunnerConfig(vocab_size=VOCAB, eos_token_id=EOS)
    config = EngineConfig(model="unused", runner="fake", max_steps_in_flight=depth, block_size=4, fake=fake)
    workers = VirtualWorkers(config)
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    core = EngineCore(scheduler, workers, INFO)  # type: ignore[arg-type]
    inbox_send, inbox = trio.open_memory_channel[Any](16)
    outbox_send, outbox_receive = trio.open_memory_channel[EngineResponse](16)
    outbox = RecordingOutbox(outbox_send, workers.events)
    sent: list[tuple[float, Any]] = []
    finished: set[str] = set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.step_loop, inbox, outbox)  # type: ignore[arg-type]
        for request in requests:
            await inbox_send.send(request)
        async for msg in outbox_receive:
            sent.append((trio.current_time(), msg))
            if isinstance(msg, EngineOutputs):
                finished.update(o.request_id for o in msg.outputs if o.finish_reason is not None)
            if len(finished) == len(requests):
                nursery.cancel_scope.cancel()
    return workers, sent


def requests(n: int, max_tokens: int) -> list[AddRequest]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [AddRequest(f"r{i}", [10 + i, 20 + i, 30 + i], params) for i in range(n)]


def tokens_by_request(sent: list[tuple[float, Any]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _, msg in sent:
        for out in msg.outputs if isinstance(msg, EngineOutputs) else []:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("depth", [1, 2])
async def test_every_request_gets_the_runner_tokens_in_order(autojump_clock, depth):
    reqs = requests(3, max_tokens=5)
    _, sent = await run_loop(depth, reqs)
    assert tokens_by_request(sent) == {r.request_id: fake_tokens(r.prompt_token_ids, 5) for r in reqs}


async def test_with_two_steps_in_flight_the_workers_never_wait_for_the_engine_core(autojump_clock):
    workers, _ = await run_loop(2, requests(3, max_tokens=20))
    dispatched = {n: t for what, n, t in workers.events if what == "dispatch"}
    collected = {n: t for what, n, t in workers.events if what == "collect"}
    # While every request still has tokens to make (the first 15 steps: the
    # last ones only finish requests, with nothing left to plan ahead), step k
    # is done at exactly k * STEP_S: each was sent before the one before it was done.
    steady = range(2, 16)
    assert all(collected[n] == n * STEP_S for n in steady)
    assert all(dispatched[n] < collected[n - 1] for n in steady)


async def test_with_one_step_in_flight_the_next_is_sent_only_after_the_last_is_taken(autojump_clock):
    workers, _ = await run_loop(1, requests(3, max_tokens=5))
    stages = [what for what, _, _ in workers.events if what != "outputs"]
    assert stages == ["dispatch", "collect"] * (len(stages) // 2)
    dispatched = {n: t for what, n, t in workers.events if what == "dispatch"}
    assert dispatched == {n: (n - 1) * STEP_S for n in dispatched}


async def test_a_steps_outputs_leave_once_the_step_after_it_is_on_its_way(autojump_clock):
    workers, _ = await run_loop(2, requests(2, max_tokens=4))
    events = [(what, n) for what, n, _ in workers.events]
    last = max(n for what, n in events if what == "dispatch")
    collected = 0
    for i, (what, n) in enumerate(events):
        if what == "collect":
            collected = n
        elif what == "outputs" and collected + 2 <= last:
            # Step k's outputs go out right after step k + 2 was sent, never before.
            assert events[i - 1] == ("dispatch", collected + 2), events[: i + 1]
