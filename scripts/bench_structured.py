"""What structured outputs cost: a batch where every request is held to a JSON schema against the same batch
unconstrained, time to first token with a cold and a warm grammar cache, and the compile time of the schema
suite (tests/helpers/json_schemas.py).

    PYTHONPATH=src:tests python scripts/bench_structured.py [--model DIR] [--batch 32] [--max-tokens 64] [--fake]

--model defaults to the default model's directory (SmolLM2-135M-Instruct, converted on first use).

- step time: ``--batch`` requests decode ``--max-tokens`` tokens each (greedy, EOS ignored, or held to a schema
  that cannot end sooner: an array of exactly 200 small objects), all at once. The two kinds of batch alternate,
  ``--rounds`` times each. From the worker's step log (``runners/steplog.py``), over the steps that decode the
  whole batch: the median time from one step's start to the next (what each token costs) and the median time
  inside ``execute()`` (the model, the bitmask applied, any wait for it); medians, since the host is shared.
- with ``--fake``, the fake runner (no model: a step costs only the engine's own work) on the model's
  tokenizer, so what the constrained rows add to the engine core and the worker shows alone: wall time per step
  (the engine's step count) over each batch, median over the rounds.
- time to first token, one request at a time (``max_tokens`` 1): unconstrained; the engine's first constrained
  request (which also builds llguidance's view of the tokenizer, once per engine core); each schema of the suite
  the first time (compiled) and the second (a cache hit).
- compile: each schema of the suite through the engine core's own ``compile_matcher`` (grammar, matcher, first
  mask), in this process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import trio
from helpers.json_schemas import SCHEMAS

import trioserve
from trioserve import JsonSchema, SamplingParams
from trioserve.runners.steplog import STEP_LOG_ENV, read_step_log, step_log_path

LONG = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 200,
    "maxItems": 200,
}
PROMPT = "List the records as JSON: "


async def run_batch(engine: trioserve.Engine, params: SamplingParams, batch: int) -> tuple[float, float, int]:
    """Run ``batch`` requests at once; the time span (perf_counter) they ran in, and the engine's steps."""
    steps = (await engine.stats()).num_steps
    started = time.perf_counter()

    async def one(i: int) -> None:
        result = await engine.generate(f"{PROMPT}#{i}", params)
        assert result.num_output_tokens == params.max_tokens, (result.finish_reason, result.num_output_tokens)

    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(one, i)
    ended = time.perf_counter()
    return started, ended, (await engine.stats()).num_steps - steps


def decode_steps_ms(log: str, spans: list[tuple[float, float, int]], batch: int) -> tuple[float, float]:
    """Median step period and median ``execute()`` time (ms) of the steps decoding the whole batch in ``spans``."""
    periods, inside = [], []
    records = read_step_log(step_log_path(log, 0))
    for start, end, _ in spans:
        steps = [r for r in records if start <= r.start_s and r.end_s <= end]
        for before, after in itertools.pairwise(steps):
            if before.num_seqs == before.num_tokens == after.num_seqs == after.num_tokens == batch:
                periods.append((after.start_s - before.start_s) * 1e3)
                inside.append(before.seconds * 1e3)
    return statistics.median(periods), statistics.median(inside)


async def ttft_ms(engine: trioserve.Engine, params: SamplingParams) -> float:
    started = time.perf_counter()
    async with engine.stream(PROMPT, params) as stream:
        async for out in stream:
            if out.token_ids:
                return (time.perf_counter() - started) * 1e3
    raise AssertionError("no token")


def compile_ms(model_dir: Path) -> list[float]:
    from trioserve.nurseries.engine_core.grammar import Tokenizer, compile_matcher

    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    tokenizer = Tokenizer(
        str(model_dir / "tokenizer.json"), int(config["vocab_size"]), eos if isinstance(eos, list) else [eos]
    )
    tokenizer.get()
    times = []
    for _, schema, _ in SCHEMAS:
        started = time.perf_counter()
        compile_matcher(tokenizer, JsonSchema(schema=schema))
        times.append((time.perf_counter() - started) * 1e3)
    return times


async def main(args: argparse.Namespace) -> None:
    model_dir = args.model
    if model_dir is None:
        from trioserve.default_model import default_model_dir

        model_dir = default_model_dir()
    print(f"model {model_dir.name}, batch {args.batch}, {args.max_tokens} tokens each, {args.rounds} rounds")
    log = os.path.join(tempfile.mkdtemp(prefix="bench-structured-"), "steps")
    os.environ[STEP_LOG_ENV] = log  # the worker inherits it
    options: dict = {"model": str(model_dir), "max_num_seqs": max(args.batch, 8)}
    if args.fake:
        options.update(runner="fake", fake=trioserve.FakeRunnerConfig(num_kv_blocks=4096))
    async with trioserve.open_engine(**options) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=4))  # warm-up
        one = SamplingParams(max_tokens=1, temperature=0)
        plain_ttft = statistics.median([await ttft_ms(engine, one) for _ in range(5)])
        first_ever = await ttft_ms(
            engine, SamplingParams(max_tokens=1, structured=JsonSchema(schema={"type": "integer"}))
        )
        suite = [SamplingParams(max_tokens=1, structured=JsonSchema(schema=s)) for _, s, _ in SCHEMAS]
        cold = [await ttft_ms(engine, p) for p in suite]
        warm = [await ttft_ms(engine, p) for p in suite]
        print(
            f"TTFT ms (median; {len(SCHEMAS)} schemas): unconstrained {plain_ttft:.1f}, first constrained request "
            f"of the engine {first_ever:.1f}, cold cache {statistics.median(cold):.1f} (max {max(cold):.1f}), "
            f"warm cache {statistics.median(warm):.1f} (max {max(warm):.1f})"
        )
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured=JsonSchema(schema=LONG))
        await engine.generate(PROMPT, SamplingParams(max_tokens=2, structured=constrained.structured))  # compiled
        spans: dict[str, list[tuple[float, float, int]]] = {"none": [], "json_schema": []}
        for _ in range(args.rounds):
            spans["none"].append(await run_batch(engine, plain, args.batch))
            spans["json_schema"].append(await run_batch(engine, constrained, args.batch))
    if args.fake:
        base, held = (statistics.median((e - s) / n * 1e3 for s, e, n in spans[k]) for k in ("none", "json_schema"))
        print(
            f"fake runner, wall ms per step at batch {args.batch}: unconstrained {base:.3f}, every request "
            f"JSON-schema-constrained {held:.3f}: {held - base:+.3f} ms per step"
        )
        return
    (base, base_in), (held, held_in) = (decode_steps_ms(log, spans[k], args.batch) for k in ("none", "json_schema"))
    print(
        f"decode step at batch {args.batch}, median ms: unconstrained {base:.2f} (in execute() {base_in:.2f}), "
        f"every request JSON-schema-constrained {held:.2f} (in execute() {held_in:.2f}): "
        f"{100 * (held / base - 1):+.1f}% per step"
    )
    times = compile_ms(model_dir)
    print(
        f"compile ({len(times)} schemas, grammar + matcher + first mask): mean {statistics.mean(times):.2f} ms, "
        f"max {max(times):.2f} ms, total {sum(times):.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fake", action="store_true", help="the fake runner on the model's tokenizer")
    trio.run(main, parser.parse_args())
