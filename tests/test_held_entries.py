"""What one request may make the front-end hold, and all of them together
(``frontend/requests/held.py``): the bound of one request is a 400 naming
``max_tokens``; the requests in flight share a budget, beyond which a
request is refused as overloaded until others end; whatever way a request
ends (finished, cut short, cancelled, refused), its entries are given back."""

from __future__ import annotations

import pytest
import trio
from helpers.fakes import SERVING
from helpers.server import post_json, serving
from helpers.waiting import in_thread

import trioserve
from trioserve import SamplingParams
from trioserve.frontend.requests.held import HeldEntries, request_entries

pytestmark = pytest.mark.fake_config(**SERVING)


def test_a_requests_entries_are_its_outputs_and_their_alternatives_times_n_within_the_context():
    params = SamplingParams(max_tokens=100, logprobs=4)
    assert request_entries(params, 1, 10, 2048) == 100 * 5
    assert request_entries(params, 3, 10, 2048) == 3 * 100 * 5
    assert request_entries(params, 1, 2000, 2048) == 48 * 5  # what the context leaves after the prompt
    assert request_entries(SamplingParams(max_tokens=2**31 - 1), 128, 11, 512) == 128 * 501
    with_prompt = SamplingParams(max_tokens=10, prompt_logprobs=2)
    assert request_entries(with_prompt, 2, 30, 2048) == 2 * (10 + 30 * 3)


def test_held_entries_refuse_one_request_too_large_and_a_request_beyond_the_shared_budget():
    held = HeldEntries(max_request_entries=100, max_held_entries=150)
    with pytest.raises(trioserve.InvalidRequestError, match=r"^max_tokens: .* at most 100 \(got 101"):
        held.take(101)
    held.take(100)
    with pytest.raises(trioserve.EngineOverloadedError, match="hold 100 output entries, and this one 60 more"):
        held.take(60)
    held.take(50)
    assert held.held == 150
    held.give(100)
    held.take(60)
    assert held.held == 110


async def test_the_budget_refuses_a_request_while_others_hold_it_and_every_end_gives_it_back(fake_config):
    # Each request below may hold 40 x 5 = 200 entries: the budget takes two at once.
    params = SamplingParams(max_tokens=40, logprobs=4, ignore_eos=True)
    config = fake_config(max_request_entries=200, max_held_entries=400, step_delay_s=0.01)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            held = engine._router.held
            with pytest.raises(trioserve.InvalidRequestError, match=r"^max_tokens: ") as refused:
                async with engine.stream_n([5, 6], params, 2):
                    pass
            assert "got 400" in str(refused.value) and held.held == 0
            async with engine.stream([5, 6], params) as first, engine.stream([7, 8], params) as second:
                assert held.held == 400
                with pytest.raises(trioserve.EngineOverloadedError, match="max_held_entries"):
                    async with engine.stream([9], params):
                        pass
                async for _ in first:
                    pass
                assert held.held == 400  # until its block is left
                async for _ in second:
                    break  # the rest is cut short when the block is left
            assert held.held == 0
            with trio.move_on_after(0.1):  # cancelled while it runs
                await engine.generate([5], params)
            assert held.held == 0
            result = await engine.generate([5], params)
            assert len(result.token_ids) == 40 and held.held == 0


async def test_the_request_of_the_issue_is_a_400_naming_max_tokens_and_a_request_beside_completes(fake_config):
    # n 128, the whole context, 20 alternatives a token: 128 x 2037 x 21 entries on this 2048-token model.
    huge = {"model": "m", "prompt": "hello", "n": 128, "max_tokens": 2**31 - 1, "ignore_eos": True, "logprobs": 20}
    small = {"model": "m", "prompt": "hello", "max_tokens": 3}
    with trio.fail_after(60):
        async with serving(fake_config(), model_name="m") as server:
            async with trio.open_nursery() as nursery:
                beside: list[tuple[int, dict]] = []

                async def request_beside() -> None:
                    beside.append(await in_thread(post_json, server, "/v1/completions", small))

                nursery.start_soon(request_beside)
                status, answer = await in_thread(post_json, server, "/v1/completions", huge)
            assert status == 400 and answer["error"]["param"] == "max_tokens", answer
            assert "lower max_tokens, n or logprobs" in answer["error"]["message"]
            assert beside[0][0] == 200 and beside[0][1]["choices"][0]["finish_reason"] == "length"
            assert server.engine is not None and server.engine._router.held.held == 0
