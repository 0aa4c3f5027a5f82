"""The whole engine on real (tiny, random-weight) transformers models, loaded
with ``from_pretrained`` from a directory, compared with transformers' own
greedy ``generate()`` for each prompt alone.

Tests that need no engine of their own share one llama engine
(``llama_engine``, a ``HostedEngine``): blocks of 4, prefix caching on.
"""

from __future__ import annotations

import random

import pytest
import trio
from helpers.concurrent import run_concurrently, run_in_one_batch
from helpers.hosted import HostedEngine, held
from helpers.reference import make_prompts, reference_greedy

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.gpu.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.model

ARCHITECTURES = ["llama", "qwen2", "qwen3"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llama_engine(tiny_model_dir):
    yield from held(
        HostedEngine(
            EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, torch_threads=1, shutdown_grace_s=3.0)
        )
    )


def make_shared_prefix_prompts(vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """A 24-token "system prompt" and prompts that share a prefix of it of
    every length, in blocks of 4: none, shorter than a block, exactly one,
    several, several and a part, all of it; and prompts that are the whole
    of another (the same prompt twice, a prompt that is a cached prefix)."""
    rng = random.Random(99)
    base = [rng.randrange(3, vocab_size) for _ in range(24)]

    def suffix(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    prompts = [base[:k] + suffix(n) for k, n in ((0, 5), (2, 3), (4, 1), (4, 6), (12, 2), (13, 4), (20, 7))]
    prompts += [base[:16], base[:16], base[:8] + suffix(8), prompts[-1]]
    return base, prompts


def reference_greedy_many(model_dir, prompt_lists: list[list[list[int]]], max_tokens: int) -> list[list[list[int]]]:
    return [reference_greedy(model_dir, prompts, max_tokens) for prompts in prompt_lists]


async def run_shared_prefix_prompts(engine, base, prompts, params) -> list[list[int]]:
    """The base prompt alone first (so its blocks are cached), then every
    prompt at once: they hit the cache, and each other as they run."""
    await engine.generate(base, params)
    return await run_concurrently(engine, prompts, params)


@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_concurrent_greedy_requests_match_transformers_generate(tiny_model_dir, arch, request):
    """Also with prefix caching (on by default): prompts sharing prefixes of
    every length give the tokens they give with caching off, and as
    transformers gives them, with and without preemptions."""
    model_dir = tiny_model_dir(arch)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    base = EngineConfig(model=str(model_dir), block_size=4, torch_threads=1, shutdown_grace_s=3.0)

    async def cached(engine) -> None:
        await engine.reset_prefix_cache()  # the shared engine may hold other tests' prompts
        before = await engine.stats()
        assert await run_concurrently(engine, prompts, params) == expected
        assert (await engine.stats()).num_preemptions == before.num_preemptions
        assert await run_shared_prefix_prompts(engine, system, shared, params) == expected_shared
        hits = (await engine.stats()).prefix_cache_hits - before.prefix_cache_hits
        assert hits >= 100  # the 24-token base alone is 6 blocks, and most prompts hit it

    # The shared engine starts as for the other tests that use it: within its own bound (HostedEngine's).
    host = request.getfixturevalue("llama_engine") if arch == "llama" else None
    with trio.fail_after(180):
        prompts = make_prompts(VOCAB_SIZE)
        system, shared = make_shared_prefix_prompts(VOCAB_SIZE)
        expected, expected_shared = await trio.to_thread.run_sync(
            reference_greedy_many, model_dir, [prompts, shared], MAX_TOKENS
        )
        if host is not None:
            assert host.config == base
            await trio.to_thread.run_sync(host.call, cached)
        else:
            async with trioserve.open_engine(config=base) as engine:
                await cached(engine)
        # A cache too small for all eight at once: requests are preempted and
        # recomputed (from what is still cached), and still produce the same tokens.
        # The scheduler's, whatever the model: once is enough.
        if arch == ARCHITECTURES[0]:
            small = base.replace(num_kv_blocks=24, max_num_batched_tokens=64)
            async with trioserve.open_engine(config=small) as engine:
                assert await run_in_one_batch(engine, prompts, params) == expected
                assert (await engine.stats()).num_preemptions > 0
                assert await run_shared_prefix_prompts(engine, system, shared, params) == expected_shared
                stats = await engine.stats()
                assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
                assert stats.num_free_blocks == stats.num_total_blocks == 24
            # One step at a time gives the same tokens; so does caching off (one engine for both: the
            # scheduler's, whatever the model), preempted requests then recomputed from nothing.
            one_step_no_cache = small.replace(max_steps_in_flight=1, enable_prefix_caching=False)
            async with trioserve.open_engine(config=one_step_no_cache) as engine:
                assert engine.info.vocab_size == VOCAB_SIZE
                assert await run_in_one_batch(engine, prompts, params) == expected
                assert (await engine.stats()).num_preemptions > 0
                assert await run_shared_prefix_prompts(engine, system, shared, params) == expected_shared
                stats = await engine.stats()
                assert stats.prefix_cache_hits == 0 and stats.num_free_blocks == stats.num_total_blocks == 24


def test_seeded_sampling_does_not_depend_on_the_batch(llama_engine):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True)

    async def scenario(engine) -> None:
        prompt = [5, 17, 33, 60, 61, 62]
        alone = (await engine.generate(prompt, seeded)).token_ids
        others = make_prompts(engine.info.vocab_size, 6)
        noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
        results: dict[str, list[int]] = {}

        async def seeded_one() -> None:
            results["seeded"] = (await engine.generate(prompt, seeded)).token_ids

        # All seven in one batch for sure (held while paused, then given to the scheduler at once).
        await engine.pause()
        async with trio.open_nursery() as nursery:
            for other in others:
                nursery.start_soon(engine.generate, other, noise)
            nursery.start_soon(seeded_one)
            while (await engine.stats()).num_waiting < len(others) + 1:
                await trio.sleep(0.01)
            await engine.resume()
        assert results["seeded"] == alone
        different_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
        assert (await engine.generate(prompt, different_seed)).token_ids != alone
        # Near-greedy settings sample the greedy tokens (found: a temperature of 1e-38 gave token 0 each time).
        greedy = (await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))).token_ids
        for near in ({"temperature": 1e-38}, {"temperature": 5e-324}, {"top_p": 1e-46}, {"top_p": 5e-324}):
            params = SamplingParams(max_tokens=12, **near)
            assert (await engine.generate(prompt, params)).token_ids == greedy, near

    llama_engine.call(scenario, bound_s=120)


def test_text_prompt_streams_text_that_matches_the_tokens(llama_engine):
    async def scenario(engine) -> None:
        pieces, tokens = [], []
        async with engine.stream("Hello, trio!", SamplingParams(max_tokens=20, temperature=0)) as stream:
            async for out in stream:
                pieces.append(out.text)
                tokens.extend(out.token_ids)
        assert out.finished
        # Random weights emit random bytes: unfinished UTF-8 at the very end is dropped.
        assert "".join(pieces) == out.cumulative_text == engine.tokenizer.decode(tokens).rstrip("\ufffd")

    llama_engine.call(scenario, bound_s=120)


async def time_to_first_token(engine, prompt: list[int], params: SamplingParams) -> tuple[float, int | None]:
    """Seconds from submitting ``prompt`` to its first token, and its cached prompt tokens."""
    started = trio.current_time()
    async with engine.stream(prompt, params) as stream:
        async for out in stream:
            if out.token_ids:
                ttft = trio.current_time() - started
            if out.finished:
                return ttft, out.num_cached_tokens
    raise AssertionError("the stream ended without a finished output")


async def test_a_second_request_with_the_same_long_prefix_computes_only_its_suffix(tmp_path):
    """The same 1,000-token prefix twice: the second request computes its
    own 8 tokens only (the engine's count of scheduled tokens says so), and
    its first token comes in less than a third of the first one's time."""
    from trioserve.gpu.tiny_models import write_tiny_model

    model_dir = write_tiny_model(
        tmp_path / "model", "llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    rng = random.Random(5)
    prefix = [rng.randrange(3, 259) for _ in range(1000)]
    suffixes = [[rng.randrange(3, 259) for _ in range(8)] for _ in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0)
    config = EngineConfig(model=str(model_dir), block_size=8, torch_threads=1, shutdown_grace_s=3.0)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            await engine.generate([5] * 1008, params)  # warm-up: a prompt as long, sharing nothing
            ttfts, scheduled = [], []
            for suffix in suffixes:
                before = (await engine.stats()).num_scheduled_tokens
                ttft, num_cached = await time_to_first_token(engine, prefix + suffix, params)
                scheduled.append((await engine.stats()).num_scheduled_tokens - before)
                ttfts.append(ttft)
            assert num_cached == 1000
            assert scheduled == [1008, 8]
            assert ttfts[1] < ttfts[0] / 3, f"time to first token: {ttfts}"
            stats = await engine.stats()
            assert stats.prefix_cache_hits == 1000 and stats.prefix_cache_queries == 3 * 1008
