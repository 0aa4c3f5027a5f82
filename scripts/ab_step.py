"""A/B of two runner settings on the same model steps, alternated step by
step in one process, so that other tenants' load hits both alike::

    PYTHONPATH=src python scripts/ab_step.py --model smollm2-135m --torch-threads 1 --a 0 --b all

Steps: a decode of 32 sequences (contexts 64-320) and a prefill of 2048
tokens (14 prompts). Prints each setting's median and best step time.
``--a``/``--b``: ``TRIOSERVE_PACKED_LINEAR`` of each (``gpu/cpu_linear.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from trioserve.bench.models import resolve_model
from trioserve.config import EngineConfig
from trioserve.gpu import cpu_linear
from trioserve.gpu.attention import METADATA_KWARG, build_metadata
from trioserve.gpu.model_runner import ModelRunner


def make_runner(model: str, threads: int, dtype: str, packed: str) -> ModelRunner:
    import os

    os.environ[cpu_linear.PACKED_LINEAR_ENV] = packed
    runner = ModelRunner(EngineConfig(model=model, torch_threads=threads, dtype=dtype, num_kv_blocks=1200))
    runner.load()
    runner.init_kv_cache(1200)
    return runner


def make_step(runner: ModelRunner, query_lens: list[int], context_lens: list[int], seed: int) -> dict:
    rng = random.Random(seed)
    blocks = list(range(runner.num_blocks))
    rng.shuffle(blocks)
    tables, at = [], 0
    for c in context_lens:
        n = -(-c // runner.block_size)
        tables.append(blocks[at : at + n])
        at += n
    meta = build_metadata(query_lens, context_lens, tables, runner.block_size, runner.kv_caches, runner.device)
    tokens = sum(query_lens)
    ids = torch.tensor([rng.randrange(runner.vocab_size) for _ in range(tokens)])
    keep = torch.tensor(list(torch.cumsum(torch.tensor(query_lens), 0) - 1))
    return {"input_ids": ids[None], "position_ids": meta.positions[None], "logits_to_keep": keep, METADATA_KWARG: meta}


@torch.inference_mode()
def time_step(runner: ModelRunner, step: dict) -> float:
    started = time.perf_counter()
    runner.model(use_cache=False, **step)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--a", default="0", help="TRIOSERVE_PACKED_LINEAR of A: 0, lm_head or all")
    p.add_argument("--b", default="all", help="TRIOSERVE_PACKED_LINEAR of B")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    model = str(resolve_model(args.model))
    runners = {"A": make_runner(model, args.torch_threads, args.dtype, args.a),
               "B": make_runner(model, args.torch_threads, args.dtype, args.b)}  # fmt: skip
    rng = random.Random(0)
    decode_ctx = [rng.randint(64, 320) for _ in range(32)]
    prefill_q = [146] * 13 + [150]
    shapes = {"decode 32": ([1] * 32, decode_ctx), "prefill 2048": (prefill_q, prefill_q)}
    for name, (q, c) in shapes.items():
        steps = {k: make_step(r, q, c, 1) for k, r in runners.items()}
        times: dict[str, list[float]] = {"A": [], "B": []}
        for _ in range(args.rounds):
            for k in ("A", "B"):
                times[k].append(time_step(runners[k], steps[k]))
        for k in ("A", "B"):
            med, best = statistics.median(times[k][1:]), min(times[k][1:])
            print(f"{name} {k}: median {med * 1e3:.1f} ms, best {best * 1e3:.1f} ms", flush=True)
        ratio = statistics.median(a / b for a, b in zip(times["A"][1:], times["B"][1:], strict=True))
        print(f"{name}: A/B per round, median {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
