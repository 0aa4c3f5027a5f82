"""LoRA adapters' cost: output tokens per second of one batch of requests
spread over 0, 1, 4 and 8 adapters, against the base model alone on an
engine without adapters, in one run (the figures are ratios to that).

    .venv/bin/python scripts/bench_lora.py [--model DIR] [--requests 32] [--max-tokens 64] [--rank 16] [--rounds 5]

The model is the built-in default (SmolLM2-135M) unless ``--model`` names
a directory. Adapters are random (PEFT's ``init_lora_weights=False``, B
scaled down so that the outputs stay text), of rank ``--rank`` on the
attention and MLP projections, built with PEFT into a temporary directory.
Both engines (one without adapters, one with ``--max-loras 8``) are open
at once. Each case runs its batch once uncounted (a warm-up), then once in
each of ``--rounds`` rounds, the cases of a round one after another in an
order turned by one each round. A case's ratio is the median over the
rounds of its rate over the baseline's rate in the same round (so a slow
minute of this shared machine touches both). Requests ignore EOS, so every
case computes the same number of tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import trio

import trioserve
from trioserve import EngineConfig, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(0.01)
        model.save_pretrained(out / f"adapter-{i}")
        paths.append(f"adapter-{i}={out / f'adapter-{i}'}")
    return paths


async def run_batch(engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> float:
    """Output tokens per second of one batch (request i with adapter ``loras[i]``)."""
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt, lora in zip(prompts, loras, strict=True):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=lora)
            nursery.start_soon(engine.generate, prompt, params)
    return len(prompts) * max_tokens / (time.perf_counter() - started)


async def measure(plain: EngineConfig, with_lora: EngineConfig, cases, prompts, args) -> dict[str, list[float]]:
    """Each case's rate in every round; both engines open at once, the
    cases of a round run one after another, in an order turned by one each
    round, so that neither the order nor a slow minute favours a case."""
    rates: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    async with trioserve.open_engine(config=plain) as base, trioserve.open_engine(config=with_lora) as lora:
        engines = {"plain": base, "lora": lora}
        for _, which, loras in cases:  # warm-up, uncounted
            await run_batch(engines[which], prompts, loras, args.max_tokens)
        for round_ in range(args.rounds):
            turn = round_ % len(cases)
            for label, which, loras in cases[turn:] + cases[:turn]:
                rates[label].append(await run_batch(engines[which], prompts, loras, args.max_tokens))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from trioserve.default_model import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    common = {"model": str(model_dir), "max_num_seqs": args.requests}
    with tempfile.TemporaryDirectory(prefix="trioserve-lora-bench-") as scratch:
        modules = build_adapters(model_dir, Path(scratch), 8, args.rank)
        names = [spec.split("=", 1)[0] for spec in modules]
        with_lora = EngineConfig(
            **common, enable_lora=True, max_loras=8, max_lora_rank=args.rank, lora_modules=tuple(modules)
        )
        cases = [("base model, engine without adapters", "plain", [None] * len(prompts))]
        for count in (0, 1, 4, 8):
            loras = [names[i % count] if count else None for i in range(len(prompts))]
            cases.append((f"{count} adapters" if count else "base model, engine with adapters", "lora", loras))
        rates = trio.run(measure, EngineConfig(**common), with_lora, cases, prompts, args)
    baseline = rates[cases[0][0]]
    shape = f"{args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens"
    print(f"LoRA: {model_dir}, {shape}, rank {args.rank}, {args.rounds} rounds")
    print(f"  {'requests':<40} {'tokens/s (median)':>18} {'ratio (median, min-max)':>26}")
    for label, _, _ in cases:
        ratios = [rate / base for rate, base in zip(rates[label], baseline, strict=True)]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"  {label:<40} {statistics.median(rates[label]):>18.1f} {spread:>26}")


if __name__ == "__main__":
    main()
