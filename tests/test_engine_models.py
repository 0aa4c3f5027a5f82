"""The whole engine on real (tiny, random-weight) transformers models, loaded
with ``from_pretrained`` from a directory, compared with transformers' own
greedy ``generate()`` for each prompt alone."""

from __future__ import annotations

import random

import pytest
import trio

import trioserve
from trioserve import EngineConfig, SamplingParams

pytestmark = pytest.mark.model

ARCHITECTURES = ["llama", "qwen2", "qwen3"]
MAX_TOKENS = 12


def make_prompts(vocab_size: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(1234)
    lengths = [3, 7, 12, 18, 25, 31, 40, 47][:n]
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in lengths]


def reference_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate(), one prompt at a time, never stopping early."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        results.append(out[0, len(prompt) :].tolist())
    return results


async def run_concurrently(engine, prompts, params) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], params)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_concurrent_greedy_requests_match_transformers_generate(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    base = EngineConfig(model=str(model_dir), block_size=4, shutdown_grace_s=3.0)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=base) as engine:
            prompts = make_prompts(engine.info.vocab_size)
            expected = await trio.to_thread.run_sync(reference_greedy, model_dir, prompts, MAX_TOKENS)
            assert await run_concurrently(engine, prompts, params) == expected
            stats = await engine.stats()
            assert stats.num_preemptions == 0
        # A cache too small for all eight at once: requests are preempted and
        # recomputed, and still produce the same tokens.
        small = base.replace(num_kv_blocks=24, max_num_batched_tokens=64)
        async with trioserve.open_engine(config=small) as engine:
            assert await run_concurrently(engine, prompts, params) == expected
            stats = await engine.stats()
            assert stats.num_preemptions > 0
            assert stats.num_free_blocks == stats.num_total_blocks == 24
        if arch == ARCHITECTURES[0]:  # one step at a time gives the same tokens (once is enough)
            async with trioserve.open_engine(config=small.replace(max_steps_in_flight=1)) as engine:
                assert await run_concurrently(engine, prompts, params) == expected
                assert (await engine.stats()).num_preemptions > 0


async def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=EngineConfig(model=str(model_dir), block_size=4)) as engine:
            prompt = [5, 17, 33, 60, 61, 62]
            alone = (await engine.generate(prompt, seeded)).token_ids
            others = make_prompts(engine.info.vocab_size, 6)
            noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
            results: dict[str, list[int]] = {}

            async def seeded_one() -> None:
                await trio.sleep(0.01)  # join a batch already running
                results["seeded"] = (await engine.generate(prompt, seeded)).token_ids

            async with trio.open_nursery() as nursery:
                for other in others:
                    nursery.start_soon(engine.generate, other, noise)
                nursery.start_soon(seeded_one)
            assert results["seeded"] == alone
            different_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
            assert (await engine.generate(prompt, different_seed)).token_ids != alone


async def test_text_prompt_streams_text_that_matches_the_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with trio.fail_after(120):
        async with trioserve.open_engine(config=EngineConfig(model=str(model_dir))) as engine:
            pieces, tokens = [], []
            async with engine.stream("Hello, trio!", SamplingParams(max_tokens=20, temperature=0)) as stream:
                async for out in stream:
                    pieces.append(out.text)
                    tokens.extend(out.token_ids)
            assert out.finished
            # Random weights emit random bytes: unfinished UTF-8 at the very end is dropped.
            assert "".join(pieces) == out.cumulative_text == engine.tokenizer.decode(tokens).rstrip("\ufffd")
