"""One layer's decode attention, the CPU kernel against the portable path,
alternated call by call in one process::

    PYTHONPATH=src python scripts/bench_decode_attention.py --torch-threads 1

Shapes of SmolLM2-135M by default (9 heads, 3 KV heads, 64 dims, blocks of
16): ``--batch`` decodes with contexts of 64-320 tokens in shuffled blocks.
Each call starts with the CPU's caches cleared of the K/V (64 MiB written
in between), as in a model step, where a layer's cache was last read a whole
step before. Prints each one's median and best time per call, and the portable path's
``index_select`` of K and V alone. With ``--shared-prefix-len N`` every
context starts with the same N tokens in the same blocks (a prefix-cache
hit), and the kernel is timed also with each sequence reading them itself
(``shared_len`` 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from trioserve.gpu import attention
from trioserve.gpu.cpu_kernels.attention import load_decode_kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens (whole blocks) every context starts with")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    shared_blocks = -(-args.shared_prefix_len // bs)
    num_blocks = 1200 + shared_blocks
    caches = [(torch.randn(num_blocks, bs, kvh, d, dtype=dtype), torch.randn(num_blocks, bs, kvh, d, dtype=dtype))]
    rng = random.Random(0)
    context = [shared_blocks * bs + rng.randint(64, 320) for _ in range(args.batch)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared_blocks)]
    tables = [prefix + [free.pop() for _ in range(-(-c // bs) - shared_blocks)] for c in context]
    q = torch.randn(1, args.batch, h, d, dtype=dtype).transpose(1, 2)  # [1, H, B, D], as transformers gives it
    k_new = torch.randn(1, kvh, args.batch, d, dtype=dtype)
    kernel = load_decode_kernel(torch.device("cpu"), dtype)
    portable = attention.build_metadata([1] * args.batch, context, tables, bs, caches, torch.device("cpu"))
    kerneled = attention.build_metadata(
        [1] * args.batch, context, tables, bs, caches, torch.device("cpu"), decode_kernel=kernel
    )

    def run(meta: attention.PagedAttentionMetadata) -> torch.Tensor:
        with attention.step_metadata(meta):
            return attention.paged_attention(q, k_new, k_new, 0, d**-0.5, None, None)

    def gather() -> None:
        for group in portable.decodes:
            attention._gather(caches[0][0], group.block_tables)
            attention._gather(caches[0][1], group.block_tables)

    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(run(kerneled), run(portable), **tolerance)
    calls = {"portable": lambda: run(portable), "kernel": lambda: run(kerneled), "index_select only": gather}
    if shared_blocks:
        unshared = attention.build_metadata(
            [1] * args.batch, context, tables, bs, caches, torch.device("cpu"), decode_kernel=kernel
        )
        unshared.decodes = [dataclasses.replace(g, shared_len=0) for g in unshared.decodes]
        assert [g.shared_len for g in kerneled.decodes] == [shared_blocks * bs]
        torch.testing.assert_close(run(kerneled), run(unshared), **tolerance)
        calls["kernel, each reading the shared prefix"] = lambda: run(unshared)
    times: dict[str, list[float]] = {name: [] for name in calls}
    flush = torch.zeros(16 * 2**20)  # 64 MiB: more than the last-level cache
    for _ in range(args.calls):
        for name, call in calls.items():
            flush.add_(1.0)
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:.2f} ms, best {min(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
