"""The step loop with constrained requests, against in-memory workers (the
fake runner's code in this process, steps of ``STEP_S`` back to back): each
step's bitmask goes out once the step before it is postprocessed and before
the next step is sent, constrained rows still sample every step with two
steps in flight, and a grammar that compiles while the last step runs is not
left waiting."""

from __future__ import annotations

import re
from typing import Any

import trio
from helpers.fakes import EOS, VOCAB, QuietFakeRunner, fake_tokens

from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.messages import AddRequest, EngineInfo, EngineOutputs, GrammarBitmask, ModelInfo, RunnerOutput
from trioserve.nurseries.engine_core.step_loop import EngineCore
from trioserve.structured import Regex

STEP_S = 0.05  # real time: the grammars compile in real threads
INFO = EngineInfo(
    model=ModelInfo(vocab_size=VOCAB, max_model_len=256, eos_token_ids=[EOS]),
    num_kv_blocks=64, block_size=4, max_model_len=256, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class Workers:
    """The executor's face over a fake runner: a step runs once it is
    dispatched and, if it awaits one, once its bitmask came."""

    engine_index = 0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = QuietFakeRunner(config)
        self.events: list[tuple[str, int]] = []
        self._waiting: list[Step] = []  # dispatched, awaiting their bitmask
        self._outputs: dict[int, RunnerOutput] = {}
        self._free_at = 0.0
        self._done_at: dict[int, float] = {}

    async def dispatch(self, step: Step) -> None:
        self.events.append(("dispatch", step.number))
        self._free_at = max(trio.current_time(), self._free_at) + STEP_S
        self._done_at[step.number] = self._free_at
        if step.scheduled.awaits_bitmask:
            self._waiting.append(step)
        else:
            self._outputs[step.number] = self.runner.execute(step.scheduled)
        await trio.lowlevel.checkpoint()

    async def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        step = self._waiting.pop(0)
        self.events.append(("bitmask", step.number))
        self._outputs[step.number] = self.runner.execute(step.scheduled, bitmask=lambda: bitmask)
        await trio.lowlevel.checkpoint()

    async def collect(self, step: Step) -> RunnerOutput:
        await trio.sleep_until(self._done_at.pop(step.number))
        while step.number not in self._outputs:  # its bitmask has not come: the engine core is wrong
            raise AssertionError(f"step {step.number} collected before its bitmask was sent")
        self.events.append(("collect", step.number))
        return self._outputs.pop(step.number)


async def run_loop(model_dir: str, requests: list[tuple[float, AddRequest]]) -> tuple[Workers, dict[str, Any]]:
    """Feed each request at its time to a step loop with two steps in flight;
    run until all finished. The workers, and each request's tokens and finish reason."""
    fake = FakeRunnerConfig(vocab_size=VOCAB, eos_token_id=EOS)
    config = EngineConfig(model=model_dir, runner="fake", max_steps_in_flight=2, block_size=4, fake=fake)
    workers = Workers(config)
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    core = EngineCore(scheduler, workers, INFO)  # type: ignore[arg-type]
    inbox_send, inbox = trio.open_memory_channel[Any](16)
    outbox_send, outbox = trio.open_memory_channel[Any](16)
    results: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.step_loop, inbox, outbox_send)

        async def feed() -> None:
            start = trio.current_time()
            for at, request in requests:
                await trio.sleep_until(start + at)
                await inbox_send.send(request)

        nursery.start_soon(feed)
        async for msg in outbox:
            for out in msg.outputs if isinstance(msg, EngineOutputs) else []:
                tokens, _ = results.get(out.request_id, ([], None))
                results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
            if len(results) == len(requests) and all(reason for _, reason in results.values()):
                nursery.cancel_scope.cancel()
    return workers, results


def text(tokens: list[int]) -> str:
    return bytes(t - 3 for t in tokens).decode()  # the tiny vocabulary: token b + 3 is byte b


async def test_each_bitmask_goes_out_between_the_step_before_and_the_step_after(tiny_model_dir):
    pattern = "[a-z]{12}"
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(max_tokens=40, structured=Regex(pattern=pattern))
    requests = [(0.0, AddRequest("plain", [10, 11, 12], plain)), (0.0, AddRequest("held", [10, 11, 12], constrained))]
    with trio.fail_after(30):
        workers, results = await run_loop(str(tiny_model_dir("llama")), requests)
    assert results["plain"] == (fake_tokens([10, 11, 12], 12), "length")
    tokens, reason = results["held"]
    assert reason == "stop" and re.fullmatch(pattern, text(tokens))
    events = workers.events
    bitmasks = [n for what, n in events if what == "bitmask"]
    # One per step it ran in: a token each (it sampled in every step), and the step planned past
    # its last token while that token was in flight (whose token is dropped).
    assert len(bitmasks) == 12 + 1
    for n in bitmasks:
        at = events.index(("bitmask", n))
        if ("collect", n - 1) in events:
            assert events.index(("collect", n - 1)) < at  # the token before it is known
        if ("dispatch", n + 1) in events:
            assert at < events.index(("dispatch", n + 1))
    # Two steps in flight throughout: each step was sent before the one ahead of it was collected.
    for n in range(2, max(bitmasks)):
        assert events.index(("dispatch", n + 1)) < events.index(("collect", n))


async def test_a_grammar_compiled_while_the_last_step_runs_is_not_left_waiting(tiny_model_dir):
    """The constrained request arrives while the only other request's last
    step runs: its compile ends then, and nothing else is left to wake the loop."""
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    constrained = SamplingParams(max_tokens=10, structured=Regex(pattern="(yes|no)"))
    requests = [(0.0, AddRequest("plain", [10, 11], plain)), (STEP_S * 0.5, AddRequest("held", [12, 13], constrained))]
    with trio.fail_after(10):  # left waiting, it would wait for good
        _, results = await run_loop(str(tiny_model_dir("llama")), requests)
    tokens, reason = results["held"]
    assert reason == "stop" and text(tokens) in ("yes", "no")
