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
