"""How often greedy decoding at bfloat16 gives transformers' tokens, with and
without our CPU kernels (the decode attention and the GEMM, which compute in
float32 and round once; issue 13; docs/benchmarks.md).

Each prompt's greedy continuation from: our engine at bfloat16 with the
kernels (the default), our engine at bfloat16 with the portable attention and
``F.linear`` (``TRIOSERVE_CPU_ATTENTION=0 TRIOSERVE_PACKED_LINEAR=0``, as
transformers runs them), transformers' ``generate()`` at bfloat16, and
transformers at float32. For each pair: how many continuations are
identical, and the mean length of the prefix they share::

    .venv/bin/python scripts/bf16_agreement.py --model smollm2-135m --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

import trio

from trioserve import EngineConfig, open_engine
from trioserve.bench.models import resolve_model
from trioserve.gpu.cpu_kernels.attention import CPU_ATTENTION_ENV
from trioserve.gpu.cpu_kernels.linear import PACKED_LINEAR_ENV
from trioserve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colours are", "To make a cup of tea, first", "In 1969, the first humans",
    "The quick brown fox", "Water boils at", "My favourite book is", "The meaning of life is",
    "import numpy as np\n", "Dear Sir or Madam,", "The best way to learn a language is",
    "Photosynthesis is the process", "Here is a list of fruits:", "The weather today is",
]  # fmt: skip


async def ours(model: str, prompts: list[list[int]], max_tokens: int, kernel: bool) -> list[list[int]]:
    os.environ[CPU_ATTENTION_ENV] = "1" if kernel else "0"  # the worker inherits them
    os.environ[PACKED_LINEAR_ENV] = "all" if kernel else "0"
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out: list[list[int]] = [[] for _ in prompts]
    async with open_engine(config=EngineConfig(model=model, dtype="bfloat16")) as engine:

        async def one(i: int) -> None:
            out[i] = list((await engine.generate(prompts[i], params)).token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return out


def transformers_greedy(model: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          min_new_tokens=max_tokens)  # fmt: skip
        out.append(gen[0, len(prompt) :].tolist())
    return out


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    model = str(resolve_model(args.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[: args.num_prompts]]
    runs = {
        "ours bf16, kernels": trio.run(ours, model, prompts, args.max_tokens, True),
        "ours bf16, portable": trio.run(ours, model, prompts, args.max_tokens, False),
        "transformers bf16": transformers_greedy(model, prompts, args.max_tokens, "bfloat16"),
        "transformers f32": transformers_greedy(model, prompts, args.max_tokens, "float32"),
    }
    print(f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each")
    for (a, ta), (b, tb) in itertools.combinations(runs.items(), 2):
        same = sum(x == y for x, y in zip(ta, tb, strict=True))
        mean = statistics.mean(shared_prefix(x, y) for x, y in zip(ta, tb, strict=True))
        print(f"  {a:<22} vs {b:<20} identical {same}/{len(prompts)}, mean shared prefix {mean:.1f} tokens")


if __name__ == "__main__":
    main()
