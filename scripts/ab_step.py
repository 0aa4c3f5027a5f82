"""A/B of runner settings on the same model steps, alternated step by step in
one process (the order reversed every other round), so that other tenants'
load hits them all alike::

    PYTHONPATH=src python scripts/ab_step.py --model smollm2-135m --torch-threads 1 --settings 0,all
    PYTHONPATH=src python scripts/ab_step.py --model smollm2-135m --torch-threads 1 \
        --settings all-kernel,all,compile,compile-unpacked

Steps: a decode of 32 sequences (contexts 64-320) and a prefill of 2048
tokens (14 prompts). Prints each setting's median and best step time, and
the median over rounds of the first setting's time over each one's.

A setting is ``TRIOSERVE_PACKED_LINEAR`` of an eager runner (``0``,
``lm_head`` or ``all``: ``gpu/cpu_kernels/linear.py``), ``lora`` (``all`` with
``--enable-lora --max-loras 8``, no adapter in the steps: ``gpu/lora.py``'s hooks alone), ``int8``
(``--quantization int8``: ``gpu/cpu_kernels/int8.py``) or ``compile`` (``--compile``:
``gpu/compiled.py``, compiled before the rounds start; ``compile-unpacked``:
with ``TRIOSERVE_PACKED_LINEAR=0``; ``compile-int8``: of ``int8``), then optionally ``-kernel``: without the
CPU decode kernel of ``gpu/cpu_kernels/attention.py`` (``TRIOSERVE_CPU_ATTENTION=0``),
``+kernel``: with it (the default where it applies), or ``-shared``: with it,
but every sequence reading the blocks it shares with others itself (no
``shared_len``); and last, optionally ``-unfused``: transformers' RMSNorm and
MLP forwards as they are (``TRIOSERVE_FUSED_ELEMENTWISE=0``:
``gpu/cpu_kernels/fused.py``).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time

import torch

from trioserve.bench.models import resolve_model
from trioserve.config import EngineConfig
from trioserve.gpu.attention import DecodeKernel, step_metadata
from trioserve.gpu.cpu_kernels import linear as cpu_linear
from trioserve.gpu.cpu_kernels.attention import load_decode_kernel
from trioserve.gpu.cpu_kernels.fused import FUSED_ENV
from trioserve.gpu.model_runner import ModelRunner


def make_runner(model: str, threads: int, dtype: str, setting: str) -> ModelRunner:
    unfused = setting.endswith("-unfused")
    setting = setting.removesuffix("-unfused")
    os.environ[FUSED_ENV] = "0" if unfused else "1"
    base, kernel = setting, ""
    if setting.endswith(("+kernel", "-kernel", "-shared")):
        base, kernel = setting[:-7], setting[-7:]
    compile_ = base.startswith("compile")
    packing = {"compile": "all", "compile-unpacked": "0", "compile-int8": "all", "int8": "all", "lora": "all"}
    os.environ[cpu_linear.PACKED_LINEAR_ENV] = packing.get(base, base)
    config = EngineConfig(
        model=model, torch_threads=threads, dtype=dtype, num_kv_blocks=1200, compile=compile_,
        quantization="int8" if base in ("int8", "compile-int8") else None, enable_lora=base == "lora", max_loras=8,
    )  # fmt: skip
    runner = ModelRunner(config)
    runner.load()
    if kernel == "+kernel":
        runner._decode_kernel = load_decode_kernel(runner.device, runner.dtype)
    elif kernel == "-kernel":
        runner._decode_kernel = None
    elif kernel == "-shared" and runner._decode_kernel is not None:
        runner._decode_kernel = functools.partial(_unshared, runner._decode_kernel)
    runner.init_kv_cache(1200)
    if compile_:
        print(f"{setting}: compiled in {runner.compile_seconds:.1f} s", flush=True)
    return runner


def _unshared(kernel: DecodeKernel, *args: object) -> None:
    """``kernel`` with every sequence reading its whole context (``shared_len`` 0)."""
    kernel(*args[:-1], 0)  # type: ignore[arg-type]


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
    p.add_argument("--settings", default="0,all", help="comma-separated settings (see the docstring)")
    p.add_argument("--steps", default="decode 32,prefill 2048", help="which steps: decode 32, prefill 2048")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    model = str(resolve_model(args.model))
    settings = args.settings.split(",")
    runners = {s: make_runner(model, args.torch_threads, args.dtype, s) for s in settings}
    rng = random.Random(0)
    decode_ctx = [rng.randint(64, 320) for _ in range(32)]
    prefill_q = [146] * 13 + [150]
    shapes = {"decode 32": ([1] * 32, decode_ctx), "prefill 2048": (prefill_q, prefill_q)}
    for name in args.steps.split(","):
        q, c = shapes[name]
        steps = {s: make_step(r, q, c, 1) for s, r in runners.items()}
        times: dict[str, list[float]] = {s: [] for s in settings}
        for i in range(args.rounds):
            for s in settings if i % 2 == 0 else reversed(settings):
                times[s].append(time_step(runners[s], steps[s]))
        first = times[settings[0]][1:]
        for s in settings:
            mine = times[s][1:]  # the first round warms up
            ratio = statistics.median(a / b for a, b in zip(first, mine, strict=True))
            print(
                f"{name} {s}: median {statistics.median(mine) * 1e3:.1f} ms, best {min(mine) * 1e3:.1f} ms; "
                f"{settings[0]}/{s} per round, median {ratio:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
