"""Requests run at once through an engine, and what each one saw."""

from __future__ import annotations

import time

import trio

import trioserve
from trioserve import SamplingParams
from trioserve.errors import EngineDeadError


async def run_concurrently(
    engine: trioserve.Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Every prompt submitted at once; each one's tokens, in the prompts' order."""
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (
            await engine.generate(prompts[i], params if isinstance(params, SamplingParams) else params[i])
        ).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


async def run_in_one_batch(
    engine: trioserve.Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """As ``run_concurrently``, but every prompt reaches the scheduler in one
    go, in their order: generation is paused while they are submitted one by
    one (the engine core holds them) and resumed once all of them wait. A
    test that counts on the requests meeting (preemptions in a small cache)
    then depends neither on how fast they arrive on a busy machine nor on the
    order Trio happens to run the submitting tasks in (found: in some orders
    the eight requests of a test fit without a preemption). ``params``: for
    every prompt, or a list, one per prompt."""
    results: dict[int, list[int]] = {}
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else params

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], each[i])).token_ids

    await engine.pause()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
            while (await engine.stats()).num_waiting < i + 1:
                await trio.sleep(0.01)
        await engine.resume()
    return [results[i] for i in range(len(prompts))]


async def assert_idle_and_clean(engine: trioserve.Engine) -> None:
    """Nothing is left of any request: not in the front-end, not in the engine core."""
    assert engine.num_requests_in_flight() == 0
    with trio.fail_after(5):
        while True:
            stats = await engine.stats()
            if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks):
                return
            await trio.sleep(0.02)


class Outcome:
    """What one request's consumer saw: every output, then one terminal event."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.started = trio.Event()


async def consume(engine: trioserve.Engine, prompt: list[int], params: SamplingParams, outcome: Outcome) -> None:
    """Stream ``prompt`` to its end, recording what came in ``outcome``."""
    await consume_stream(engine.stream(prompt, params), outcome)


async def consume_stream(stream: trioserve.RequestStream, outcome: Outcome) -> None:
    """Enter ``stream`` and read it to its end, recording what came in ``outcome``."""
    try:
        async with stream:
            async for out in stream:
                outcome.token_ids += out.token_ids
                outcome.started.set()
                outcome.finish_reason = out.finish_reason
    except EngineDeadError as exc:
        outcome.error = exc
    outcome.ended_at = time.monotonic()
    outcome.started.set()
