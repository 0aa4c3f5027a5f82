"""LoRA adapters' cost: output tokens per second of one batch of requests
spread over 0, 1, 4 and 8 adapters, against the base model alone on an
engine without adapters, in one run (the figures are ratios to that).

    .venv/bin/python scripts/bench_lora.py [--model DIR] [--requests 32] [--max-tokens 64] [--rank 16]

The model is the built-in default (SmolLM2-135M) unless ``--model`` names
a directory. Adapters are random (PEFT's ``init_lora_weights=False``, B
scaled down so that the outputs stay text), of rank ``--rank`` on the
attention and MLP projections, built with PEFT into a temporary directory.
Each configuration runs its batch once uncounted (a warm-up), then
``--repeats`` times; the figure is the best of those. Requests ignore EOS,
so every configuration computes the same number of tokens.
"""

from __future__ import annotations

import argparse
import random
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


async def measure(config: EngineConfig, prompts: list[list[int]], loras: list[str | None], args) -> float:
    """The best output tokens per second of the batch (request i with adapter ``loras[i]``)."""
    best = 0.0
    async with trioserve.open_engine(config=config) as engine:
        for attempt in range(args.repeats + 1):
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for prompt, lora in zip(prompts, loras, strict=True):
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, lora=lora)
                    nursery.start_soon(engine.generate, prompt, params)
            rate = len(prompts) * args.max_tokens / (time.perf_counter() - started)
            if attempt:  # the first is the warm-up
                best = max(best, rate)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from trioserve.default_model import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    common = {"model": str(model_dir), "max_num_seqs": args.requests}
    with tempfile.TemporaryDirectory(prefix="trioserve-lora-bench-") as scratch:
        modules = build_adapters(model_dir, Path(scratch), 8, args.rank)
        names = [spec.split("=", 1)[0] for spec in modules]
        plain = trio.run(measure, EngineConfig(**common), prompts, [None] * len(prompts), args)
        lora_config = EngineConfig(
            **common, enable_lora=True, max_loras=8, max_lora_rank=args.rank, lora_modules=tuple(modules)
        )
        rows = [("base model, engine without adapters", plain)]
        for count in (0, 1, 4, 8):
            loras = [names[i % count] if count else None for i in range(len(prompts))]
            label = f"{count} adapters" if count else "base model, engine with adapters"
            rows.append((label, trio.run(measure, lora_config, prompts, loras, args)))
    shape = f"{args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens"
    print(f"LoRA: {model_dir}, {shape}, rank {args.rank}")
    print(f"  {'requests':<40} {'tokens/s':>9} {'ratio':>6}")
    for label, rate in rows:
        print(f"  {label:<40} {rate:>9.1f} {rate / plain:>6.2f}x")


if __name__ == "__main__":
    main()
