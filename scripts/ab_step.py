"""A/B of two runner settings on the same model steps, alternated step by
step in one process, so that other tenants' load hits both alike::

    PYTHONPATH=src python scripts/ab_step.py --model smollm2-135m --torch-threads 1 --a 0 --b all
    PYTHONPATH=src python scripts/ab_step.py --model smollm2-135m --torch-threads 1 --a all --b compile

Steps: a decode of 32 sequences (contexts 64-320) and a prefill of 2048
tokens (14 prompts). Prints each setting's median and best step time.
``--a``/``--b``: ``TRIOSERVE_PACKED_LINEAR`` of each (``gpu/cpu_linear.py``:
0, lm_head or all), or ``compile`` for the compiled model (``gpu/compiled.py``,
compiled before the rounds start).
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
from trioserve.gpu.attention import step_metadata
from trioserve.gpu.model_runner import ModelRunner


def make_runner(model: str, threads: int, dtype: str, setting: str) -> ModelRunner:
    import os

    compile_ = setting == "compile"
    os.environ[cpu_linear.PACKED_LINEAR_ENV] = "all" if compile_ else setting
    config = EngineConfig(model=model, torch_threads=threads, dtype=dtype, num_kv_blocks=1200, compile=compile_)
    runner = ModelRunner(config)
    runner.load()
    runner.init_kv_cache(1200)
    if compile_:
        print(f"{setting}: compiled in {runner.compile_seconds:.1f} s", flush=True)
    return runner


@torch.inference_mode()  # as the runner's own steps: a compiled model would recompile for other tensors
def make_step(runner: ModelRunner, query_lens: list[int], context_lens: list[int], seed: int) -> dict:
    rng = random.Random(seed)
    blocks = list(range(runner.num_blocks))
    rng.shuffle(blocks)
    tables, at = [], 0
    for c in context_lens:
        n = -(-c // runner.block_size)
        tables.append(blocks[at : at + n])
        at += n
    meta = runner.metadata(query_lens, context_lens, tables)
    tokens = sum(query_lens)
    ids = torch.tensor([rng.randrange(runner.vocab_size) for _ in range(tokens)])
    keep = torch.tensor(list(torch.cumsum(torch.tensor(query_lens), 0) - 1))
    return {"ids": ids[None], "positions": meta.positions[None], "keep": keep, "meta": meta}


@torch.inference_mode()
def time_step(runner: ModelRunner, step: dict) -> float:
    assert runner._forward is not None
    started = time.perf_counter()
    with step_metadata(step["meta"]):
        runner._forward(step["ids"], step["positions"], step["keep"])
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--a", default="0", help="TRIOSERVE_PACKED_LINEAR of A (0, lm_head or all), or compile")
    p.add_argument("--b", default="all", help="the same for B")
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
