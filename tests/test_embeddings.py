"""Embeddings (``Engine.encode``, ``encode_batch``; ``trioserve.pooling``):
on the fake runner, whose vectors are a function of the prompt
(``pooling.fake_vector``), through the whole engine (scheduler, workers,
front-end); a generation request on an embedding engine, and the reverse,
refused naming the task."""

from __future__ import annotations

import pytest
import trio

import trioserve
from trioserve import InvalidRequestError, SamplingParams
from trioserve.pooling import FAKE_HIDDEN_SIZE, PoolingParams, fake_vector

pytestmark = pytest.mark.fake_config(num_kv_blocks=64, step_delay_s=0.002, max_num_batched_tokens=64)


async def test_encode_gives_each_prompts_vector_pooled_cut_and_normalised_as_asked(fake_config):
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(task="embed", pooling_type="mean")) as engine:
            ids = [5, 6, 7, 8]
            out = await engine.encode(ids)
            assert out.num_prompt_tokens == 4
            assert out.embedding == pytest.approx(fake_vector(ids, PoolingParams(type="mean")), abs=1e-6)
            cut = await engine.encode(ids, dimensions=8, normalize=False)
            assert cut.embedding == pytest.approx(
                fake_vector(ids, PoolingParams(type="mean", normalize=False, dimensions=8)), abs=1e-6
            )
            # A prompt prefilled over several steps (64 tokens a step), and many at once, batched.
            prompts = [[3 + (i * j) % 200 for j in range(10 + 17 * i)] for i in range(12)]
            outs = await engine.encode_batch(prompts)
            for prompt, got in zip(prompts, outs, strict=True):
                assert got.embedding == pytest.approx(fake_vector(prompt, PoolingParams(type="mean")), abs=1e-6)
            stats = await engine.stats()
            assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            with pytest.raises(InvalidRequestError, match=r"^dimensions: at most the model's 32 components"):
                await engine.encode(ids, dimensions=FAKE_HIDDEN_SIZE + 1)
            with pytest.raises(InvalidRequestError, match=r"^task: this model serves embeddings"):
                await engine.generate(ids, SamplingParams(max_tokens=2))


async def test_a_generation_engine_refuses_an_embedding_naming_the_task(fake_config):
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config()) as engine:
            with pytest.raises(InvalidRequestError, match=r"^task: this model serves text generation"):
                await engine.encode([5, 6])
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=2))).num_output_tokens == 2
