"""The engine on a CUDA device (issue 35): greedy tokens as transformers'
own on the same device, prefix caching, preemption, and kill -9 of the worker
under load, on the tiny random-weight models.

Marked ``cuda``: skipped where torch sees no CUDA device (tests/conftest.py);
``scripts/gpu_check.sh`` runs them on one. The device comes from one place,
``DEVICE``: ``TRIOSERVE_CUDA_TESTS_DEVICE`` (default ``cuda``). Set to ``cpu``
it runs these tests on the CPU instead, not skipped, so that their own code is
checked on a machine without a GPU::

    TRIOSERVE_CUDA_TESTS_DEVICE=cpu .venv/bin/python -m pytest tests/test_cuda.py

Identity is checked at float32, where both sides compute in full precision
(tiny models whose top two logits are rarely within float noise of each
other: ``gpu/tiny_models.py``); bfloat16, the CUDA default, only for
agreement, since a kernel's rounding may flip a near tie.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import trio
from helpers.concurrent import Outcome, assert_idle_and_clean, consume, run_concurrently, run_in_one_batch
from helpers.fakes import children, wait_no_children
from helpers.reference import greedy_tokens, make_prompts

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.errors import EngineDeadError
from trioserve.gpu.tiny_models import VOCAB_SIZE

DEVICE = os.environ.get("TRIOSERVE_CUDA_TESTS_DEVICE", "cuda")

pytestmark = [pytest.mark.cuda, pytest.mark.model]

BLOCK = 16  # the default block size: what the CUDA path serves with
MAX_TOKENS = 12
BOUND_S = 180.0  # each test, engines and references included (a CPU run is the slow one)


def config(model_dir: Any, **options: Any) -> EngineConfig:
    """An engine on ``DEVICE`` at float32, blocks of ``BLOCK``, with the tests' short grace."""
    defaults = {"dtype": "float32", "block_size": BLOCK, "torch_threads": 1, "shutdown_grace_s": 3.0}
    return EngineConfig(model=str(model_dir), device=DEVICE, **{**defaults, **options})


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# --- transformers' own greedy tokens on DEVICE ---------------------------------

_lock = threading.Lock()
_models: dict[tuple[str, str], Any] = {}


def reference(model_dir: Any, prompts: list[list[int]], max_tokens: int, dtype: str = "float32") -> list[list[int]]:
    """transformers' greedy ``generate()`` on ``DEVICE`` with eager attention,
    one prompt at a time, never stopping early: ``max_tokens`` for each."""
    import torch
    from transformers import AutoModelForCausalLM

    with _lock:
        key = (str(model_dir), dtype)
        if key not in _models:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), attn_implementation="eager", dtype=getattr(torch, dtype)
            )
            _models[key] = model.to(DEVICE).eval()
        return [greedy_tokens(_models[key], prompt, max_tokens, DEVICE) for prompt in prompts]


async def reference_async(model_dir: Any, prompts: list[list[int]], max_tokens: int, dtype: str = "float32"):
    return await trio.to_thread.run_sync(reference, model_dir, prompts, max_tokens, dtype)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before the first that differs."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# --- the tests -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_concurrent_greedy_requests_give_transformers_tokens_on_the_device(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts(VOCAB_SIZE)
    with trio.fail_after(BOUND_S):
        expected = await reference_async(model_dir, prompts, MAX_TOKENS)
        async with trioserve.open_engine(config=config(model_dir)) as engine:
            assert await run_concurrently(engine, prompts, greedy()) == expected
            # Each alone: the same tokens as in a batch.
            assert [(await engine.generate(p, greedy())).token_ids for p in prompts[:3]] == expected[:3]
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_bfloat16_agrees_with_transformers_at_bfloat16(tiny_model_dir):
    """bfloat16 (the CUDA default) agrees with transformers at bfloat16 on the
    same device: the first token of all prompts but two (a near tie, rounded
    differently by another kernel), and at least half of all tokens before the
    first that differs. (On the CPU, 2026-11-29: 8 of 8 first tokens, 76 of
    96 tokens; a kernel that is wrong agrees on next to none.)"""
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(VOCAB_SIZE)
    with trio.fail_after(BOUND_S):
        expected = await reference_async(model_dir, prompts, MAX_TOKENS, "bfloat16")
        async with trioserve.open_engine(config=config(model_dir, dtype="bfloat16")) as engine:
            got = await run_concurrently(engine, prompts, greedy())
        assert all(len(tokens) == MAX_TOKENS for tokens in got)
        first = sum(g[0] == e[0] for g, e in zip(got, expected, strict=True))
        agreed = sum(common_prefix(g, e) for g, e in zip(got, expected, strict=True))
        assert first >= len(prompts) - 2 and agreed >= len(prompts) * MAX_TOKENS // 2, (got, expected)
        assert await wait_no_children() == []


async def test_a_repeated_prefix_is_served_from_the_cache_with_the_same_tokens(tiny_model_dir):
    """A 40-token prompt twice: the second finds its two full blocks (32
    tokens) cached; a prompt sharing them with another suffix too. Every
    output is transformers' own."""
    model_dir = tiny_model_dir("llama")
    prefix = make_prompts(VOCAB_SIZE)[-1][:40]
    other = [*prefix[:32], 7, 8, 9, 10, 11]
    with trio.fail_after(BOUND_S):
        expected, expected_other = await reference_async(model_dir, [prefix, other], MAX_TOKENS)
        async with trioserve.open_engine(config=config(model_dir)) as engine:
            first = await engine.generate(prefix, greedy())
            assert (first.token_ids, first.num_cached_tokens) == (expected, 0)
            before = await engine.stats()
            again = await engine.generate(prefix, greedy())
            assert (again.token_ids, again.num_cached_tokens) == (expected, 2 * BLOCK)
            shared = await engine.generate(other, greedy())
            assert (shared.token_ids, shared.num_cached_tokens) == (expected_other, 2 * BLOCK)
            after = await engine.stats()
            assert after.prefix_cache_hits - before.prefix_cache_hits >= 4 * BLOCK
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_a_cache_too_small_for_the_batch_preempts_and_the_tokens_are_unchanged(tiny_model_dir):
    """Eight prompts needing 21 blocks of 16 between them, in a cache of 8:
    requests are preempted and recomputed, with caching on and off."""
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(VOCAB_SIZE)
    small = config(model_dir, num_kv_blocks=8, max_num_batched_tokens=64)
    with trio.fail_after(BOUND_S):
        expected = await reference_async(model_dir, prompts, MAX_TOKENS)
        for caching in (True, False):
            async with trioserve.open_engine(config=small.replace(enable_prefix_caching=caching)) as engine:
                assert await run_in_one_batch(engine, prompts, greedy()) == expected, caching
                stats = await engine.stats()
                assert stats.num_preemptions > 0, caching
                assert stats.num_free_blocks == stats.num_total_blocks == 8
        assert await wait_no_children() == []


async def test_kill_9_of_the_worker_under_load_ends_every_request_and_the_engine_restarts(tiny_model_dir):
    """Eight greedy streams, then SIGKILL to the worker: each request ends,
    resumed on the restarted engine with the tokens it would have had
    (transformers'), or with ``EngineDeadError``; the new engine serves, and
    no process is left after it."""
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(VOCAB_SIZE)
    max_tokens = 200  # long enough to be running at the kill (the tiny model's context is 512)
    with trio.fail_after(BOUND_S):
        expected = await reference_async(model_dir, prompts, max_tokens)
        async with trioserve.open_engine(config=config(model_dir, restart_backoff_s=0.05)) as engine:
            old = engine.info
            outcomes = [Outcome() for _ in prompts]
            async with trio.open_nursery() as nursery:
                for prompt, outcome in zip(prompts, outcomes, strict=True):
                    nursery.start_soon(consume, engine, prompt, greedy(max_tokens), outcome)
                for outcome in outcomes:
                    await outcome.started.wait()
                os.kill(old.worker_pids[0], signal.SIGKILL)
                killed_at = time.monotonic()
            for outcome, tokens in zip(outcomes, expected, strict=True):
                if outcome.error is not None:
                    assert isinstance(outcome.error, EngineDeadError), outcome.error
                else:
                    assert (outcome.finish_reason, outcome.token_ids) == ("length", tokens)
            assert any(o.ended_at is not None and o.ended_at > killed_at for o in outcomes)  # the kill met them
            await engine.wait_ready()
            assert engine.num_restarts == 1 and engine.health == "ready"
            assert engine.info.engine_pid != old.engine_pid
            assert not set(engine.info.worker_pids) & set(old.worker_pids)
            assert (await engine.generate(prompts[0], greedy())).token_ids == expected[0][:MAX_TOKENS]
            # Only the new engine's processes are left.
            assert {p.pid for p in children()} == {engine.info.engine_pid, *engine.info.worker_pids}
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_a_kv_cache_sized_from_device_memory_and_eager_decodes_give_the_same_tokens(tiny_model_dir):
    """``gpu_memory_utilization``: the cache takes what the share leaves after
    the model and a full step's activations (gpu/cuda_memory.py), within the
    share; ``enforce_eager`` (no decode graphs) gives the graphs' tokens."""
    if DEVICE == "cpu":
        pytest.skip("gpu_memory_utilization sizes the cache from CUDA memory (refused on the CPU)")
    import torch

    from trioserve.rpc import DescribeShard

    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(VOCAB_SIZE)
    share = 0.3
    with trio.fail_after(BOUND_S):
        expected = await reference_async(model_dir, prompts, MAX_TOKENS)
        for options in ({"gpu_memory_utilization": share}, {"enforce_eager": True}):
            async with trioserve.open_engine(config=config(model_dir, **options)) as engine:
                assert await run_concurrently(engine, prompts, greedy()) == expected
                if "gpu_memory_utilization" in options:
                    [shard] = await engine.collective_rpc(DescribeShard())
                    _free, total = torch.cuda.mem_get_info()
                    assert shard.num_kv_blocks > 0 and 0 < shard.kv_cache_bytes < share * total
                await assert_idle_and_clean(engine)
        assert await wait_no_children() == []
