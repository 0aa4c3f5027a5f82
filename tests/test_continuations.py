"""Continuations in the engine core: a request resumed after the engine core
it ran on died comes with the tokens it had generated
(``AddRequest.output_token_ids``), which count as its output. The scheduler
alone, then the step loop against in-memory workers (the fake runner's code
in this process)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import trio
from helpers.fakes import EOS, VOCAB, QuietFakeRunner, Script, fake_tokens
from helpers.scheduling import make_scheduler

from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.core.request import Request
from trioserve.core.step import Step
from trioserve.messages import AddRequest, EngineInfo, EngineOutputs, GrammarBitmask, ModelInfo, RunnerOutput
from trioserve.nurseries.engine_core.step_loop import EngineCore
from trioserve.pooling import PoolingParams
from trioserve.structured import Regex

PROMPT = [10, 11, 12, 13]


def continuation(outputs: list[int], prompt: list[int] = PROMPT, **params: Any) -> Request:
    return Request("c", prompt, SamplingParams(**params), eos_token_ids=[EOS], output_token_ids=outputs)


def run_step(sched, token: int) -> list:
    planned = sched.schedule()
    assert planned is not None
    req_ids = [r.request_id for r in planned.samplers]
    return sched.postprocess(planned, RunnerOutput(req_ids, [token] * len(req_ids)))


# --- the scheduler -------------------------------------------------------------


def test_a_continuation_reaches_the_workers_with_its_tokens_so_far_as_output():
    sched = make_scheduler()
    sched.add(continuation([50, 51]))
    planned = sched.schedule()
    assert planned is not None
    (new,) = planned.scheduled.new_requests
    # The workers count penalties, min_tokens and the seeded draw's position from the prompt's end.
    assert (new.token_ids, new.num_prompt_tokens, new.num_computed_tokens) == ([*PROMPT, 50, 51], 4, 0)
    assert planned.scheduled.num_scheduled_tokens == {"c": 6}
    (out,) = sched.postprocess(planned, RunnerOutput(["c"], [52]))
    assert (out.new_token_ids, out.finish_reason) == ([52], None)  # only what is new goes out
    assert sched.get_request("c").output_token_ids == [50, 51, 52]  # type: ignore[union-attr]
    sched.check_invariants()


def test_a_continuations_tokens_so_far_count_against_max_tokens_and_min_tokens():
    sched = make_scheduler()
    sched.add(continuation([50, 51], max_tokens=3))
    assert [o.finish_reason for o in run_step(sched, 52)] == ["length"]
    sched.add(continuation([50, 51], min_tokens=3))  # (its id is free again)
    assert [o.finish_reason for o in run_step(sched, EOS)] == [None]  # 3 tokens: EOS does not stop it yet
    assert [o.finish_reason for o in run_step(sched, EOS)] == ["stop"]
    sched.check_invariants()


@pytest.mark.parametrize(
    ("outputs", "params", "message"),
    [
        ([50, -1], {}, "output_token_ids: token ids must be non-negative integers"),
        ([50, 51], {"max_tokens": 2}, r"output_token_ids: the tokens so far already end the request \(length\)"),
        ([50, EOS], {}, r"already end the request \(stop\)"),
        ([50, 9], {"stop_token_ids": [9]}, r"already end the request \(stop\)"),
        ([50] * 60, {}, "the prompt and 60 tokens so far \\(64\\) leave no room to generate within max_model_len=64"),
        ([50], {"pooling": PoolingParams()}, "output_token_ids: an embedding request generates no tokens"),
    ],
)
def test_a_continuation_that_could_not_go_on_is_refused_naming_its_tokens_so_far(outputs, params, message):
    sched = make_scheduler()
    with pytest.raises(ValueError, match=message):
        sched.add(continuation(outputs, **params))
    assert not sched.has_unfinished()


def test_a_continuation_larger_than_the_whole_kv_cache_is_refused():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"\(9\) are more than the KV cache holds \(8 tokens\)"):
        sched.add(continuation([50] * 5))
    sched.add(continuation([50] * 4))  # 8 tokens: it fits, and samples one more


def test_a_new_constraint_is_moved_past_a_continuations_tokens_so_far():
    script = Script([40, 41, 42])
    assert continuation([40, 41]).replay(script) is None
    assert script.accepted == [40, 41]
    assert continuation([40, 99]).replay(Script([40, 41, 42])) == (
        "output_token_ids: its constraint refuses token 99 (at index 1)"
    )
    assert "already complete its constraint" in (continuation([40, 41]).replay(Script([40, 41])) or "")
    assert continuation([]).replay(Script([40])) is None  # a fresh request: nothing to replay


# --- the step loop ---------------------------------------------------------------

STEP_S = 0.01
INFO = EngineInfo(
    model=ModelInfo(vocab_size=VOCAB, max_model_len=256, eos_token_ids=[EOS]),
    num_kv_blocks=64, block_size=4, max_model_len=256, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class Workers:
    """The executor's face over a fake runner in this process: each step runs
    when it is dispatched (once its bitmask came, if it awaits one)."""

    engine_index = 0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = QuietFakeRunner(config)
        self._waiting: list[Step] = []
        self._outputs: dict[int, RunnerOutput] = {}

    async def dispatch(self, step: Step) -> None:
        if step.scheduled.awaits_bitmask:
            self._waiting.append(step)
        else:
            self._outputs[step.number] = self.runner.execute(step.scheduled)
        await trio.lowlevel.checkpoint()

    async def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        step = self._waiting.pop(0)
        self._outputs[step.number] = self.runner.execute(step.scheduled, bitmask=lambda: bitmask)
        await trio.lowlevel.checkpoint()

    async def collect(self, step: Step) -> RunnerOutput:
        await trio.sleep(STEP_S)
        return self._outputs.pop(step.number)


async def run_core(model_dir: str, requests: list[AddRequest], **fake: Any) -> dict[str, tuple[list[int], Any]]:
    """Each request's tokens and its finish reason (with the error, if any)
    from a fresh engine core's step loop, run until every one has finished."""
    fake_config = FakeRunnerConfig(vocab_size=VOCAB, eos_token_id=EOS, **fake)
    config = EngineConfig(model=model_dir, runner="fake", block_size=4, fake=fake_config)
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8, max_model_len=256)
    core = EngineCore(scheduler, Workers(config), INFO)  # type: ignore[arg-type]
    inbox_send, inbox = trio.open_memory_channel[Any](16)
    outbox_send, outbox = trio.open_memory_channel[Any](16)
    results: dict[str, tuple[list[int], Any]] = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.step_loop, inbox, outbox_send)
            for request in requests:
                await inbox_send.send(request)
            async for msg in outbox:
                for out in msg.outputs if isinstance(msg, EngineOutputs) else []:
                    tokens, _ = results.get(out.request_id, ([], None))
                    results[out.request_id] = (tokens + out.new_token_ids, out.error or out.finish_reason)
                if len(results) == len(requests) and all(reason for _, reason in results.values()):
                    nursery.cancel_scope.cancel()
    return results


async def test_a_continuation_at_any_token_gives_the_rest_of_the_undisturbed_run(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=12, min_tokens=5)
    undisturbed = (await run_core(model_dir, [AddRequest("r", PROMPT, params)], eos_every=11))["r"]
    tokens, reason = undisturbed
    assert reason == "stop" and tokens[-1] == EOS and len(tokens) == 8  # the runner's EOS after 11 tokens in all
    continuations = [AddRequest(f"r{k}", PROMPT, params, output_token_ids=tokens[:k]) for k in range(1, len(tokens))]
    resumed = await run_core(model_dir, continuations, eos_every=11)
    assert resumed == {f"r{k}": (tokens[k:], "stop") for k in range(1, len(tokens))}


async def test_a_continuation_that_cannot_go_on_ends_with_an_error_and_the_others_run(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    requests = [
        AddRequest("done", PROMPT, params, output_token_ids=[50, 51, 52]),
        AddRequest("fine", PROMPT, params, output_token_ids=fake_tokens(PROMPT, 1)),
    ]
    results = await run_core(model_dir, requests)
    assert results["done"] == ([], "output_token_ids: the tokens so far already end the request (length)")
    assert results["fine"] == (fake_tokens(PROMPT, 3)[1:], "length")


def text(tokens: list[int]) -> str:
    return bytes(t - 3 for t in tokens).decode()  # the tiny vocabulary: token b + 3 is byte b


async def test_a_constrained_continuation_has_its_matcher_moved_past_its_tokens_so_far(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    pattern = "[a-z]{3}[0-9]{3}"
    params = SamplingParams(max_tokens=20, structured=Regex(pattern=pattern))
    tokens, reason = (await run_core(model_dir, [AddRequest("r", PROMPT, params)]))["r"]
    assert reason == "stop" and re.fullmatch(pattern, text(tokens))
    requests = [AddRequest(f"r{k}", PROMPT, params, output_token_ids=tokens[:k]) for k in range(1, len(tokens))]
    # Digits where letters must come: the matcher refuses them as it is moved past them.
    wrong = [t + 3 for t in b"12"]
    requests.append(AddRequest("wrong", PROMPT, params, output_token_ids=wrong))
    results = await run_core(model_dir, requests)
    assert results.pop("wrong") == ([], f"output_token_ids: its constraint refuses token {wrong[0]} (at index 0)")
    assert results == {f"r{k}": (tokens[k:], "stop") for k in range(1, len(tokens))}
