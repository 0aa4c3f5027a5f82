"""Decode steps replayed from CUDA graphs (vLLM's default on CUDA; ``--enforce-eager`` turns it off).

A decode step launches a few hundred small kernels (every layer's norms,
projections, rotary embedding, attention); at small batches on a GPU the
launches, not the arithmetic, set the step's time. At start, once the KV cache
exists, the runner captures the model's forward for one packed decode batch per
*bucket* size (``graph_buckets``: 1, 2, 4, then every multiple of 8 up to
``max_num_seqs``), each reading its inputs from static buffers; a step whose
rows are all single tokens is padded to the next bucket, its inputs copied into
the buffers, and its graph replayed. Anything else runs eagerly: prefills,
prompt logprobs, pooling, adapters (``--enable-lora``), tensor-parallel shards,
a batch over the largest bucket.

Padding rows read and write one *scratch block*, an extra block of the cache
that the block manager never hands out (``scratch_block`` is ``num_blocks``):
each has context length 1, its token's K/V written there, so it stays finite
and touches no request's blocks. Every graph reads the same buffers (sliced to
its bucket) and shares one memory pool, the largest captured first.

The capture is one function (``cuda_capture``); ``eager_capture`` stands in
for it where there is no CUDA device, running the same static-buffer path
eagerly, so that the padding, the buffers and the scratch block are tested
on the CPU (``TRIOSERVE_DECODE_GRAPHS=eager`` makes a runner use it).

Invariants: the step's decode kernel reads the cache in place and never
synchronises with the host (the Triton one on CUDA), and its grid depends on
shapes only; block tables are ``max_blocks_per_seq`` wide in every replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from trioserve.gpu.attention import DecodeGroup, DecodeKernel, KVCache, PagedAttentionMetadata, step_metadata
from trioserve.gpu.compiled import Forward

log = logging.getLogger(__name__)

GRAPHS_ENV = "TRIOSERVE_DECODE_GRAPHS"  # "eager": the graph path's buffers with eager calls (tests, any device)
MAX_BUCKET = 512  # no graph for batches past this (vLLM's default largest capture size)

# capture(fn) -> replay: replay() runs what fn() ran and returns its output tensor (the same one each time).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_buckets(max_num_seqs: int, largest: int = MAX_BUCKET) -> list[int]:
    """The batch sizes captured: of 1, 2, 4 and the multiples of 8, those up to
    the first that holds ``max_num_seqs`` rows (at most ``largest``)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1 (got {max_num_seqs})")
    need = min(max_num_seqs, largest)
    sizes = [1, 2, 4, *range(8, largest + 1, 8)]
    return sizes[: bisect.bisect_left(sizes, need) + 1]


def bucket_for(buckets: list[int], batch: int) -> int | None:
    """The smallest bucket that holds ``batch`` rows (None: none does)."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """No graph: each replay calls ``fn`` again (what a replay computes, without CUDA)."""
    return fn


def cuda_capture(pool: Any) -> Capture:
    """Capture into CUDA graphs sharing memory ``pool`` (``torch.cuda.graph_pool_handle()``),
    after two warm-up calls on a side stream (first calls allocate and build kernels)."""

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


@dataclass(frozen=True)
class DecodeRows:
    """A step's rows, each one token: its id and its sequence's context (that token included)."""

    input_ids: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


class DecodeGraphs:
    """One captured forward per bucket over static input buffers (see the module's docstring)."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: KVCache,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        decode_kernel: DecodeKernel,
        buckets: list[int],
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.decode_kernel = decode_kernel
        self.buckets = buckets
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # device memory the graphs hold (their pool), on CUDA
        top = buckets[-1]
        # Every row starts as padding: captures and warm-ups touch the scratch block alone.
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), scratch_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((top, self.width), scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(top, dtype=torch.long, device=device)
        self.rows = torch.arange(top, dtype=torch.long, device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    def capture_all(self, capture: Capture) -> None:
        """Capture every bucket's forward, the largest first (the smaller
        ones then fit in the memory the pool already holds)."""
        started = time.perf_counter()
        cuda = self.input_ids.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.input_ids.device) if cuda else 0
        for bucket in reversed(self.buckets):
            self._replays[bucket] = capture(partial(self._run, bucket))
        self.capture_seconds = time.perf_counter() - started
        self.memory_bytes = torch.cuda.memory_reserved(self.input_ids.device) - before if cuda else 0
        log.info(
            "decode graphs: %d batch sizes (%d to %d) captured in %.1f s, holding %.0f MiB",
            len(self.buckets), self.buckets[0], self.buckets[-1], self.capture_seconds, self.memory_bytes / 2**20,
        )  # fmt: skip

    def covers(self, rows: DecodeRows) -> bool:
        """Whether a graph serves these rows: few enough, and every context within a table's width."""
        return (
            bucket_for(self.buckets, len(rows.input_ids)) is not None
            and max(rows.context_lens) <= self.width * self.block_size
        )

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """The logits ``[B, V]`` of the rows (B of them), from the graph of the
        bucket that holds them (``covers`` first)."""
        count = len(rows.input_ids)
        bucket = bucket_for(self.buckets, count)
        if bucket is None or bucket not in self._replays:
            raise ValueError(f"decode graphs: no captured graph holds {count} rows ({self.buckets})")
        self._fill(rows, bucket)
        return self._replays[bucket]()[:count]

    def _fill(self, rows: DecodeRows, bucket: int) -> None:
        bs, pad = self.block_size, bucket - len(rows.input_ids)
        positions = [n - 1 for n in rows.context_lens]
        tables = [t[: self.width] + [self.scratch_block] * (self.width - len(t)) for t in rows.block_tables]
        slots = [tables[i][p // bs] * bs + p % bs for i, p in enumerate(positions)]
        padding = self.scratch_block * bs
        host = torch.tensor(
            [
                rows.input_ids + [0] * pad,
                positions + [0] * pad,
                slots + [padding] * pad,
                rows.context_lens + [1] * pad,
            ],
            dtype=torch.long,
        )
        self.input_ids[:bucket].copy_(host[0], non_blocking=True)
        self.positions[:bucket].copy_(host[1], non_blocking=True)
        self.slots[:bucket].copy_(host[2], non_blocking=True)
        self.context_lens[:bucket].copy_(host[3], non_blocking=True)
        table = torch.tensor(tables + [[self.scratch_block] * self.width] * pad, dtype=torch.long)
        self.tables[:bucket].copy_(table, non_blocking=True)

    def _run(self, bucket: int) -> torch.Tensor:
        """The forward over the first ``bucket`` rows of the buffers (what a graph captures)."""
        meta = PagedAttentionMetadata(
            kv_caches=self.kv_caches,
            block_size=self.block_size,
            positions=self.positions[:bucket],
            slot_mapping=self.slots[:bucket],
            decodes=[DecodeGroup(self.rows[:bucket], self.tables[:bucket], self.context_lens[:bucket])],
            prefills=[],
            decode_kernel=self.decode_kernel,
        )
        with step_metadata(meta):
            return self.forward(self.input_ids[:bucket][None], self.positions[:bucket][None], self.rows[:bucket])
