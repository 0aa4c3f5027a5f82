"""Time to scale 1 -> 2 engines while loaded, on the mp and Ray backends.

The fake runner at a fixed step (default 20 ms) over any model directory's
tokenizer; ``--streams`` greedy requests stream throughout. For each backend,
in turn for ``--rounds`` rounds: open one engine, start the load, time
``Engine.scale(2)`` (from the call to the new engine ready and routed to),
then a request sent at once (which goes to the new, least loaded engine)
to its first token, then scale back to 1 (the departing engine's requests
drain: about one request's length). Ray's local cluster is started by the front-end (its
start is the engine's open, not timed here) unless ``--ray-address`` is given.

    .venv/bin/python scripts/bench_scale.py --model DIR [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.config import FakeRunnerConfig


async def one_round(config: EngineConfig, streams: int) -> tuple[float, float, float]:
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    async with trioserve.open_engine(config=config) as engine:
        stop = trio.Event()

        async def stream(i: int) -> None:
            while not stop.is_set():
                await engine.generate([5 + i % 50, 6, 7], params)

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(stream, i)
            await trio.sleep(1.0)  # loaded
            started = time.monotonic()
            await engine.scale(2, drain_timeout_s=60)
            up = time.monotonic() - started
            # A request sent now goes to the least loaded engine: the new one, whose first token comes
            # this long after the scale returned.
            async with engine.stream([9, 9, 9], SamplingParams(max_tokens=1)) as probe:
                async for _ in probe:
                    break
            assert probe.engine_index == 1, probe.engine_index
            first = time.monotonic() - started - up
            started = time.monotonic()
            await engine.scale(1, drain_timeout_s=60)
            down = time.monotonic() - started
            stop.set()
    return up, first, down


async def main(args: argparse.Namespace) -> None:
    fake = FakeRunnerConfig(step_delay_s=args.step_s, num_kv_blocks=4096)
    configs = {
        "mp": EngineConfig(model=args.model, runner="fake", fake=fake, block_size=4),
        "ray": EngineConfig(
            model=args.model,
            runner="fake",
            fake=fake,
            block_size=4,
            data_parallel_backend="ray",
            ray_address=args.ray_address,
        ),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name in list(configs)[:: 1 if round_ % 2 == 0 else -1]:
            results[name].append(await one_round(configs[name], args.streams))
            up, first, down = results[name][-1]
            print(f"{name} round {round_ + 1}: up {up:.2f} s, new engine's first token {first:.3f} s, down {down:.2f}")
    for name, runs in results.items():
        up, first, down = (statistics.median(r[k] for r in runs) for k in range(3))
        print(f"{name}: scale 1 -> 2 median {up:.2f} s (new engine's first token {first:.3f} s), 2 -> 1 {down:.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory (its tokenizer)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--ray-address", default=None)
    trio.run(main, parser.parse_args())
