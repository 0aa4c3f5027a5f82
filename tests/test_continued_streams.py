"""Requests resumed at any token, the front-end and the engine core together
in this process. A request's ``RequestState`` (its detokenizer, stop
strings, logprobs; each of its ``n`` samples) is fed by an engine core's
step loop; that engine core "dies" after any number of tokens (its step
loop and its workers' state are dropped, outputs it had not sent are lost)
and the request is sent to a fresh one as ``frontend/engines/resume.py``
sends it: ``RequestState.add_request``, a continuation of every token it
received. What its consumer sees must be what it sees of the undisturbed
request, field for field. Hypothesis, on the fake runner and on a tiny
real model (greedy and seeded sampling, with penalties)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from helpers.fakes import EOS, VOCAB, QuietFakeRunner
from helpers.scheduling import make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.core.step import Step
from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.requests.parallel_sampling import child_params, child_request_id
from trioserve.frontend.requests.state import RequestState
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import AbortRequests, EngineInfo, EngineOutputs, ModelInfo, RunnerOutput, SchedulerOutput
from trioserve.nurseries.engine_core.step_loop import EngineCore

INFO = EngineInfo(
    model=ModelInfo(vocab_size=VOCAB, max_model_len=256, eos_token_ids=[EOS]),
    num_kv_blocks=64, block_size=4, max_model_len=256, engine_pid=1, worker_pids=[2],
)  # fmt: skip
PROMPT = [1, 40, 75, 80, 91, 3]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Workers:
    """The executor's face over a runner in this process: a step runs when it is dispatched."""

    engine_index = 0

    def __init__(self, config: EngineConfig, runner: Any) -> None:
        self.config, self.runner = config, runner
        self._outputs: dict[int, RunnerOutput] = {}

    async def dispatch(self, step: Step) -> None:
        self._outputs[step.number] = self.runner.execute(step.scheduled)
        await trio.lowlevel.checkpoint()

    async def collect(self, step: Step) -> RunnerOutput:
        await trio.sleep(0.01)
        return self._outputs.pop(step.number)

    def forget(self, req_ids: list[str]) -> None:
        """The engine core died: the runner holds nothing of these any more."""
        self.runner.execute(SchedulerOutput([], [], {}, 0, req_ids))


def new_states(tokenizer: Tokenizer, params: SamplingParams, n: int) -> list[RequestState]:
    """The ``n`` samples of one request, as ``RequestStream`` makes them."""
    return [
        RequestState(
            child_request_id("r", i), list(PROMPT), child_params(params, i), tokenizer, eos_token_ids=[EOS], index=i
        )
        for i in range(n)
    ]


async def run(states: list[RequestState], workers_of_a_life: Callable[[], Workers], kills: list[int]) -> None:
    """Run ``states`` to their end; the engine core of life ``k`` dies once
    ``kills[k]`` tokens in all have reached the front-end."""
    by_id = {s.request_id: s for s in states}
    received, life = 0, 0
    while unfinished := [s for s in states if not s.finished]:
        limit = kills[life] if life < len(kills) else math.inf
        workers = workers_of_a_life()
        core = EngineCore(make_scheduler(num_blocks=64, max_num_seqs=8, max_model_len=256), workers, INFO)  # type: ignore[arg-type]
        inbox_send, inbox = trio.open_memory_channel[Any](64)
        outbox_send, outbox = trio.open_memory_channel[Any](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.step_loop, inbox, outbox_send)
            for state in unfinished:
                state.num_resumes += life > 0  # (resume.py counts it so)
                await inbox_send.send(state.add_request())
            async for msg in outbox:
                for out in msg.outputs if isinstance(msg, EngineOutputs) else []:
                    state = by_id[out.request_id]
                    if received >= limit or state.finished:
                        continue  # dead before it reached the front-end; or aborted, its last token in flight
                    assert out.finish_reason != "error", out.error
                    if state.process(out):  # a stop string: the engine core is told
                        await inbox_send.send(AbortRequests(request_ids=[out.request_id]))
                    received += len(out.new_token_ids)
                if received >= limit or all(s.finished for s in states):
                    nursery.cancel_scope.cancel()
        workers.forget([s.request_id for s in unfinished])
        life += 1


def outputs(states: list[RequestState]) -> list[RequestOutput]:
    """Each sample's outputs merged: what a consumer that read it to the end has."""
    got = []
    for state in states:
        output = state.collector.poll()
        assert output is not None and output.finished
        got.append(output)
    return got


def same_but_resumes(a: RequestOutput, b: RequestOutput) -> None:
    for name in ("text", "token_ids", "cumulative_text", "num_output_tokens", "finish_reason", "stop_reason", "index"):
        assert getattr(a, name) == getattr(b, name), name
    assert [(lp.top_token_ids, lp.rank) for lp in a.logprobs or []] == [
        (lp.top_token_ids, lp.rank) for lp in b.logprobs or []
    ]
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def check_resumed_run(tokenizer, workers_of_a_life, params, n, data) -> None:
    undisturbed = new_states(tokenizer, params, n)
    trio.run(run, undisturbed, workers_of_a_life, [], clock=trio.testing.MockClock(autojump_threshold=0))
    first = outputs(undisturbed)
    # A stop string cut from the undisturbed text (it ends the request there), or none.
    text = first[0].text
    if text and data.draw(st.booleans(), label="stop string"):
        start = data.draw(st.integers(0, len(text) - 1), label="stop at")
        stop = text[start : start + data.draw(st.integers(1, 3), label="stop length")]
        include = data.draw(st.booleans(), label="include_stop_str_in_output")
        params = msgspec.structs.replace(params, stop=[stop], include_stop_str_in_output=include)
        undisturbed = new_states(tokenizer, params, n)
        trio.run(run, undisturbed, workers_of_a_life, [], clock=trio.testing.MockClock(autojump_threshold=0))
        first = outputs(undisturbed)
    total = sum(o.num_output_tokens for o in first)
    kills = sorted(data.draw(st.sets(st.integers(0, max(total - 1, 0)), max_size=3), label="deaths after"))
    resumed = new_states(tokenizer, params, n)
    trio.run(run, resumed, workers_of_a_life, kills, clock=trio.testing.MockClock(autojump_threshold=0))
    for before, after in zip(first, outputs(resumed), strict=True):
        same_but_resumes(after, before)
    assert sum(s.num_resumes for s in resumed) >= len(kills) > 0 or not kills


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir("llama"))


@SETTINGS
@given(
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 24),
    min_tokens=st.integers(0, 3),
    eos_every=st.sampled_from([0, 11, 13]),
    logprobs=st.sampled_from([None, 0, 2]),
    penalties=st.booleans(),
    data=st.data(),
)
def test_a_request_resumed_at_any_token_on_the_fake_runner_reads_as_if_undisturbed(
    tiny_model_dir, tokenizer, n, max_tokens, min_tokens, eos_every, logprobs, penalties, data
):
    fake = FakeRunnerConfig(vocab_size=VOCAB, eos_token_id=EOS, eos_every=eos_every, logprobs=True)
    config = EngineConfig(model=str(tiny_model_dir("llama")), runner="fake", block_size=4, fake=fake)
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), logprobs=logprobs, seed=7,
        frequency_penalty=0.5 if penalties else 0.0, repetition_penalty=1.2 if penalties else 1.0,
    )  # fmt: skip
    check_resumed_run(tokenizer, lambda: Workers(config, QuietFakeRunner(config)), params, n, data)


@pytest.fixture(scope="module")
def model_runner(tiny_model_dir):
    pytest.importorskip("torch")
    from trioserve.gpu.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64)
    runner = ModelRunner(config)
    runner.init_kv_cache(runner.load().max_num_kv_blocks)
    return config, runner


@pytest.mark.model
@settings(SETTINGS, max_examples=15)
@given(
    n=st.integers(1, 2),
    seeded=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
    logprobs=st.sampled_from([None, 2]),
    data=st.data(),
)
def test_a_request_resumed_at_any_token_on_a_tiny_model_reads_as_if_undisturbed(
    tokenizer, model_runner, n, seeded, seed, logprobs, data
):
    config, runner = model_runner
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": seed} if seeded else {"temperature": 0.0}
    params = SamplingParams(
        max_tokens=12, min_tokens=2, logprobs=logprobs, frequency_penalty=0.4, presence_penalty=0.2,
        repetition_penalty=1.1, **sampling,
    )  # fmt: skip
    check_resumed_run(tokenizer, lambda: Workers(config, runner), params, n, data)
