"""A batch of prompts on ``/v1/completions`` (vLLM's and OpenAI's list
``prompt``): each prompt's ``n`` samples are the choices, prompt by prompt
(choice ``p * n + j``), each what the prompt gives alone; the usage counts
every prompt; streamed the same; what a batch cannot have is a 400 naming
the field, and a request beside it completes."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from helpers.fakes import SERVING
from helpers.server import post_json, serving, wait_blocks_free
from helpers.waiting import in_thread

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "m"


async def test_each_prompts_samples_are_the_choices_in_order_whole_and_streamed(fake_config):
    prompts = ["Once upon", "a time there", "was"]
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            api = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=20)
            complete = api.completions.create
            alone = [await in_thread(lambda p=p: complete(model=MODEL, prompt=p, max_tokens=4)) for p in prompts]
            batch = await in_thread(lambda: complete(model=MODEL, prompt=prompts, n=2, max_tokens=4))
            stream = await in_thread(lambda: complete(model=MODEL, prompt=prompts, n=2, max_tokens=4, stream=True))
            chunks = await in_thread(list, stream)
            ids = await in_thread(lambda: complete(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3))
            await wait_blocks_free(server)
            assert server.engine is not None and server.engine._router.held.held == 0
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 4
    streamed = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in batch.choices]
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


async def test_what_a_batch_cannot_have_is_a_400_naming_it_and_a_request_beside_completes(fake_config):
    bad = [
        ({"prompt": ["a", "b"], "echo": True}, "echo"),
        ({"prompt": ["a", "b"], "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": ["a", [5, 6]]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a"] * 1025}, "prompt"),
        ({"prompt": ["a"] * 600, "n": 2}, "n"),
    ]
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            for extra, param in bad:
                beside: list[tuple[int, dict[str, Any]]] = []

                async def request_beside(beside: list[tuple[int, dict[str, Any]]] = beside) -> None:
                    beside.append(
                        await in_thread(
                            post_json, server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}
                        )
                    )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(request_beside)
                    status, answer = await in_thread(
                        post_json, server, "/v1/completions", {"model": MODEL, "max_tokens": 3, **extra}
                    )
                assert status == 400 and answer["error"]["param"] == param, (extra, answer)
                assert beside[0][0] == 200, beside
            await wait_blocks_free(server)
