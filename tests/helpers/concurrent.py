"""Requests run at once through an engine."""

from __future__ import annotations

import trio

import trioserve
from trioserve import SamplingParams


async def run_concurrently(
    engine: trioserve.Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Every prompt submitted at once; each one's tokens, in the prompts' order."""
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], params)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


async def run_in_one_batch(
    engine: trioserve.Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """As ``run_concurrently``, but every prompt reaches the scheduler in one
    go, in their order: generation is paused while they are submitted one by
    one (the engine core holds them) and resumed once all of them wait. A
    test that counts on the requests meeting (preemptions in a small cache)
    then depends neither on how fast they arrive on a busy machine nor on the
    order Trio happens to run the submitting tasks in (found: in some orders
    the eight requests of a test fit without a preemption)."""
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], params)).token_ids

    await engine.pause()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
            while (await engine.stats()).num_waiting < i + 1:
                await trio.sleep(0.01)
        await engine.resume()
    return [results[i] for i in range(len(prompts))]
