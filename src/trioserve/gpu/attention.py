"""Paged attention for transformers models, registered as ``"trioserve_paged"``.

One model call runs a packed batch: ``input_ids [1, T]`` holds several
sequences back to back. Each layer's attention call

1. writes the new keys and values into that layer's paged cache, flat-indexed
   by ``slot_mapping`` (slot = block_id * block_size + offset in block);
2. attends every query token of a sequence to that sequence's context read
   back through its block table: the token at position p sees positions
   <= p (and > p - sliding_window on sliding layers).

Sequences with one new token (decodes) attend through the step's
``decode_kernel`` where there is one (one call that reads the cache in place:
on the CPU at float32 and bfloat16, ``gpu/cpu_kernels/attention.py``; on CUDA,
Triton's, ``gpu/triton_attention.py``, whose ``prefill_kernel`` also serves
every multi-token sequence of the step in one call); otherwise, sorted by
context length, they share padded SDPA calls with a length mask over K/V
gathered from the cache, in groups whose gathered K/V stay in the CPU's
caches (``DECODE_GROUP_BYTES``; one group on other devices). Multi-token
sequences (prefills, prefill chunks) get one SDPA call each.

Everything the layers need is built once per step by ``build_metadata``; the
runner makes it current around the model call (``step_metadata``), and each
layer's attention, the custom op ``trioserve::paged_attention``, reads it
there: a compiled model (``gpu/compiled.py``) carries no Python object
through its graph, and none of the metadata reaches a dynamo guard.

Invariants: cache tensors are ``[num_blocks, block_size, KVH, D]`` and hold
only finite values (padding reads are masked, never NaN); a sequence's block
table covers its whole context.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "trioserve_paged"
CUDA_ATTENTION_ENV = "TRIOSERVE_CUDA_ATTENTION"  # "portable": no Triton kernels on CUDA

log = logging.getLogger(__name__)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [N, bs, KVH, D]

# On the CPU, decodes attend in groups whose gathered K (and V) take about this
# much memory. Gathering the whole batch at once (tens of MB per layer at batch
# 32) evicts it from the caches before SDPA reads it back; groups of about 2 MiB
# made decode attention 2.5-3x faster here (5-7 ms -> 2 ms per layer at batch
# 32, ~200 tokens of context), and sorting by length keeps padding small.
DECODE_GROUP_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with several new tokens: its slice of the packed batch."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step, new ones included
    block_table: torch.Tensor  # [ceil(context_len / bs)] long, on device


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with one new token that attend in one padded call."""

    token_index: torch.Tensor  # [B] long: packed row of each one's token
    block_tables: torch.Tensor  # [B, nb] long: nb blocks hold the longest context; 0-padded
    context_lens: torch.Tensor  # [B] long
    shared_len: int = 0  # the first tokens of every context, in the same blocks in every table (the kernel's groups)


@dataclass(frozen=True)
class PrefillBatch:
    """Every multi-token sequence of the step, for a prefill kernel's one call
    (K/V read from the cache, the new ones written there first)."""

    query_starts: torch.Tensor  # [S] long: first packed row of each
    query_lens: torch.Tensor  # [S] long
    context_lens: torch.Tensor  # [S] long: tokens in the cache after this step, new ones included
    block_tables: torch.Tensor  # [S, nb] long: nb blocks hold the longest context; 0-padded
    max_query_len: int


class PrefillKernel(Protocol):
    """A prefill attention over all the step's multi-token sequences in one
    call, reading their K/V through the block tables (``gpu/triton_attention.py``)."""

    def __call__(
        self,
        query: torch.Tensor,  # [1, H, T, D]
        k_cache: torch.Tensor,  # [N, bs, KVH, D]
        v_cache: torch.Tensor,
        query_starts: torch.Tensor,  # [S]
        query_lens: torch.Tensor,  # [S]
        context_lens: torch.Tensor,  # [S]
        block_tables: torch.Tensor,  # [S, nb]
        out: torch.Tensor,  # [T, H, D]: the rows of the sequences' queries written
        scale: float,
        window: int | None,
        softcap: float | None,
        max_query_len: int,
    ) -> None: ...


class DecodeKernel(Protocol):
    """A decode attention that reads the cache in place (``gpu/cpu_kernels/attention.py``)."""

    def __call__(
        self,
        query: torch.Tensor,  # [1, H, T, D]
        k_cache: torch.Tensor,  # [N, bs, KVH, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, nb]
        context_lens: torch.Tensor,  # [B]
        token_index: torch.Tensor,  # [B]: the rows of query and out
        out: torch.Tensor,  # [T, H, D]: rows token_index written
        scale: float,
        window: int | None,
        softcap: float | None,
        shared_len: int,  # leading tokens held in the same blocks by every table: read once for all
    ) -> None: ...


@dataclass
class PagedAttentionMetadata:
    """One step's view of the paged cache, shared by every layer."""

    kv_caches: KVCache
    block_size: int
    positions: torch.Tensor  # [T] long: position of each packed token in its sequence
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each packed token
    decodes: list[DecodeGroup]
    prefills: list[PrefillSeq]
    decode_kernel: DecodeKernel | None = None  # else the decodes gather their K/V and run SDPA
    prefill_kernel: PrefillKernel | None = None  # else each prefill gathers its K/V and runs SDPA
    prefill_batch: PrefillBatch | None = None  # with a prefill kernel and prefills: their tensors
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)  # built by the first layer

    def decode_mask(self, index: int, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, L]`` bool: True where a token of decode group ``index`` may attend."""
        key = ("decode", index, window)
        if key not in self._masks:
            group = self.decodes[index]
            lens = group.context_lens  # [B]
            kv_pos = torch.arange(group.block_tables.shape[1] * self.block_size, device=lens.device)
            q_pos = (lens - 1)[:, None]  # [B, 1]
            mask = kv_pos[None, :] <= q_pos  # [B, L]
            if window is not None:
                mask &= kv_pos[None, :] > q_pos - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """``[query_len, context_len]`` bool: causal (and windowed) for one prefill."""
        key = ("prefill", index, window)
        if key not in self._masks:
            seq = self.prefills[index]
            device = self.slot_mapping.device
            kv_pos = torch.arange(seq.context_len, device=device)  # [L]
            q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=device)[:, None]
            mask = kv_pos[None, :] <= q_pos  # [n, L]
            if window is not None:
                mask &= kv_pos[None, :] > q_pos - window
            self._masks[key] = mask
        return self._masks[key]


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    kv_caches: KVCache,
    device: torch.device,
    decode_group_blocks: int | None = None,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> PagedAttentionMetadata:
    """Metadata for a packed batch of sequences, in packing order.

    Sequence i contributes ``query_lens[i]`` tokens, the last ones of its
    ``context_lens[i]``; ``block_tables[i]`` must cover ``context_lens[i]``.
    ``decode_group_blocks`` caps sequences x padded blocks in one decode
    group; by default it is sized by ``DECODE_GROUP_BYTES`` on the CPU and
    unlimited elsewhere. With a ``decode_kernel`` (which copies nothing) the
    groups are instead the sequences that share their first blocks (a prefix
    cache hit: ``_shared_prefix_groups``), and one group of the rest. With a
    ``prefill_kernel``, the multi-token sequences attend in one call of it.
    """
    num_seqs = len(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)  # [S, MB]
    q_lens = torch.tensor(query_lens, dtype=torch.long)  # [S]
    ctx_lens = torch.tensor(context_lens, dtype=torch.long)  # [S]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [T]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [S]
    offsets = torch.arange(seq_of_token.numel()) - starts[seq_of_token]  # [T]
    positions = (ctx_lens - q_lens)[seq_of_token] + offsets  # [T]
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]

    if decode_group_blocks is None and decode_kernel is None:
        decode_group_blocks = _decode_group_blocks(kv_caches, device)
    starts_list = starts.tolist()
    prefills = [
        PrefillSeq(
            starts_list[i], n, context_lens[i], _used_blocks(block_tables[i], context_lens[i], block_size, device)
        )
        for i, n in enumerate(query_lens)
        if n > 1
    ]
    if decode_kernel is None:
        grouped = [(rows, 0) for rows in _group_decodes(query_lens, context_lens, block_size, decode_group_blocks)]
    else:
        grouped = _shared_prefix_groups(query_lens, context_lens, block_tables, block_size)
    decodes = [
        _decode_group(rows, shared, starts_list, context_lens, block_tables, block_size, device)
        for rows, shared in grouped
    ]
    return PagedAttentionMetadata(
        kv_caches=kv_caches,
        block_size=block_size,
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        decodes=decodes,
        prefills=prefills,
        decode_kernel=decode_kernel,
        prefill_kernel=prefill_kernel,
        prefill_batch=_prefill_batch(query_lens, context_lens, block_tables, starts_list, device)
        if prefill_kernel is not None and prefills
        else None,
    )


def _prefill_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    starts: list[int],
    device: torch.device,
) -> PrefillBatch:
    rows = [i for i, n in enumerate(query_lens) if n > 1]
    width = max(len(block_tables[i]) for i in rows)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PrefillBatch(
        query_starts=as_tensor([starts[i] for i in rows]),
        query_lens=as_tensor([query_lens[i] for i in rows]),
        context_lens=as_tensor([context_lens[i] for i in rows]),
        block_tables=as_tensor([block_tables[i] + [0] * (width - len(block_tables[i])) for i in rows]),
        max_query_len=max(query_lens[i] for i in rows),
    )


def attention_kernels(device: torch.device, dtype: torch.dtype) -> tuple[DecodeKernel | None, PrefillKernel | None]:
    """The kernels a worker's steps use on ``device``: on CUDA, Triton's
    (``gpu/triton_attention.py``; ``TRIOSERVE_CUDA_ATTENTION=portable`` or no
    Triton: none); on the CPU, the decode kernel of ``gpu/cpu_kernels/attention.py``
    where it applies. None: the portable path (gather and SDPA)."""
    if device.type == "cuda":
        if os.environ.get(CUDA_ATTENTION_ENV, "triton") == "portable":
            return None, None
        try:
            from trioserve.gpu import triton_attention
        except ImportError as exc:
            log.warning("no Triton (%s): CUDA attention gathers K/V and runs SDPA (install the triton extra)", exc)
            return None, None
        return triton_attention.decode_attention, triton_attention.prefill_attention
    from trioserve.gpu.cpu_kernels.attention import load_decode_kernel

    return load_decode_kernel(device, dtype), None


def _decode_group_blocks(kv_caches: KVCache, device: torch.device) -> int | None:
    """How many (sequence, block) pairs of one layer's K take ``DECODE_GROUP_BYTES``
    (None, no limit, off the CPU)."""
    if device.type != "cpu" or not kv_caches:
        return None
    k = kv_caches[0][0]  # [N, bs, KVH, D]
    return max(1, DECODE_GROUP_BYTES // (k[0].numel() * k.element_size()))


def _group_decodes(
    query_lens: list[int], context_lens: list[int], block_size: int, max_blocks: int | None
) -> list[list[int]]:
    """The one-token sequences (their indices), shortest context first, cut
    into groups of at most ``max_blocks`` sequences x padded blocks (a lone
    sequence longer than that is a group of its own)."""
    blocks = {i: -(-c // block_size) for i, (n, c) in enumerate(zip(query_lens, context_lens, strict=True)) if n == 1}
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(blocks, key=blocks.__getitem__):
        if current and max_blocks is not None and (len(current) + 1) * blocks[i] > max_blocks:
            groups.append(current)
            current = []
        current.append(i)
    return [*groups, current] if current else groups


def _shared_prefix_groups(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[tuple[list[int], int]]:
    """The one-token sequences (their indices) for the decode kernel, as
    ``(rows, shared_len)``: those whose tables start with the same block,
    with the tokens of the blocks all their tables start with (never a
    block holding a member's newest token: that one is being written); then
    the others, sharing nothing. The kernel reads shared blocks once per group
    rather than once per sequence: with a long common prompt (a system
    prompt), most of a decode's K/V."""
    by_first: dict[int, list[int]] = {}
    for i, n in enumerate(query_lens):
        if n == 1:
            by_first.setdefault(block_tables[i][0], []).append(i)
    groups: list[tuple[list[int], int]] = []
    alone: list[int] = []
    for rows in by_first.values():
        limit = min((context_lens[i] - 1) // block_size for i in rows)  # whole blocks before every newest token
        first = block_tables[rows[0]]
        shared = 0
        if len(rows) > 1:
            while shared < limit and all(block_tables[i][shared] == first[shared] for i in rows):
                shared += 1
        if shared:
            groups.append((rows, shared * block_size))
        else:
            alone.extend(rows)
    return [*groups, (sorted(alone), 0)] if alone else groups


def _decode_group(
    rows: list[int],
    shared_len: int,
    starts: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    width = max(-(-context_lens[i] // block_size) for i in rows)  # blocks of the longest context
    tables = [block_tables[i][:width] for i in rows]
    tables = [t + [0] * (width - len(t)) for t in tables]
    return DecodeGroup(
        token_index=torch.tensor([starts[i] for i in rows], dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),  # [B, width]
        context_lens=torch.tensor([context_lens[i] for i in rows], dtype=torch.long, device=device),
        shared_len=shared_len,
    )


def _used_blocks(blocks: list[int], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The blocks holding the first ``context_len`` tokens: ``[ceil(context_len / bs)]``."""
    return torch.tensor(blocks[: -(-context_len // block_size)], dtype=torch.long, device=device)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of q ``[B, H, Tq, D]`` over k, v ``[B, KVH, L, D]`` -> ``[B, H, Tq, D]``.

    ``mask`` is bool (True: attend), broadcastable to ``[B, H, Tq, L]``; None
    means causal with Tq == L (allowed only without ``softcap``).
    """
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    assert mask is not None
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, H, L, D]
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, H, Tq, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Cache ``[N, bs, KVH, D]`` read through tables ``[B, nb]`` -> ``[B, KVH, nb * bs, D]``."""
    b, nb = tables.shape
    _, bs, kvh, d = cache.shape
    # index_select copies whole blocks; advanced indexing (cache[tables]) is several times slower on the CPU.
    blocks = cache.index_select(0, tables.reshape(-1))  # [B * nb, bs, KVH, D]
    return blocks.view(b, nb * bs, kvh, d).transpose(1, 2)


class AttentionModule(Protocol):
    """What the attention function reads of the transformers attention
    module that calls it."""

    layer_idx: int
    scaling: float


# The metadata of the step being run, set by ``step_metadata`` around a model
# call: a compiled model cannot carry Python objects through its graph, so the
# attention op reads it from here (per thread, per context).
_STEP: ContextVar[PagedAttentionMetadata | None] = ContextVar("trioserve_step_metadata", default=None)


@contextmanager
def step_metadata(meta: PagedAttentionMetadata) -> Iterator[None]:
    """Run model calls inside this block: every layer's attention reads ``meta``."""
    token = _STEP.set(meta)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_attention_forward(
    module: AttentionModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry: query ``[1, H, T, D]``, key/value
    ``[1, KVH, T, D]`` -> ``([1, T, H, D], None)``. ``attention_mask`` is unused:
    masks come from the step's metadata (``step_metadata``). The whole call is
    one op, ``trioserve::paged_attention``: opaque to ``torch.compile``, and one
    line of a profile.
    """
    scale = float(module.scaling if scaling is None else scaling)
    out = torch.ops.trioserve.paged_attention(query, key, value, module.layer_idx, scale, sliding_window, softcap)
    return out[None], None


@torch.library.custom_op("trioserve::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``paged_attention`` as a custom op, what every layer calls. It writes the
    layer's KV cache, which is not an argument: a compiled graph sees a pure op."""
    return paged_attention(query, key, value, layer_idx, scale, window, softcap)


@paged_attention_op.register_fake
def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One layer over the step's packed batch: store the new K/V, attend ->
    ``[T, H, D]``. Reads the metadata of the enclosing ``step_metadata``."""
    meta = _STEP.get()
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside step_metadata(...)")
    layer = _Layer(*meta.kv_caches[layer_idx], scale, window, softcap)
    # New K/V: [1, KVH, T, D] -> [T, KVH, D], into their slots.
    _, kv_heads, _, head_dim = key.shape
    layer.k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    layer.v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for i, group in enumerate(meta.decodes):
        if meta.decode_kernel is not None:
            meta.decode_kernel(
                query, layer.k_cache, layer.v_cache, group.block_tables, group.context_lens, group.token_index,
                out, layer.scale, layer.window, layer.softcap, group.shared_len,
            )  # fmt: skip
        else:
            out[group.token_index] = _decode_attention(query, meta, i, layer)
    if meta.prefill_kernel is not None and meta.prefill_batch is not None:
        batch = meta.prefill_batch
        meta.prefill_kernel(
            query, layer.k_cache, layer.v_cache, batch.query_starts, batch.query_lens, batch.context_lens,
            batch.block_tables, out, layer.scale, layer.window, layer.softcap, batch.max_query_len,
        )  # fmt: skip
        return out
    for i, seq in enumerate(meta.prefills):
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = _prefill_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows], meta, i, layer)
    return out


@dataclass(frozen=True)
class _Layer:
    """What one layer's call brings: its cache and its attention details."""

    k_cache: torch.Tensor  # [N, bs, KVH, D]
    v_cache: torch.Tensor
    scale: float
    window: int | None
    softcap: float | None


def _decode_attention(query: torch.Tensor, meta: PagedAttentionMetadata, index: int, layer: _Layer) -> torch.Tensor:
    """The one-token sequences of decode group ``index`` in one padded call: -> ``[B, H, D]``."""
    group = meta.decodes[index]
    q = query[0][:, group.token_index].transpose(0, 1)[:, :, None]  # [B, H, 1, D]
    k = _gather(layer.k_cache, group.block_tables)  # [B, KVH, L, D]
    v = _gather(layer.v_cache, group.block_tables)
    mask = meta.decode_mask(index, layer.window)  # [B, 1, 1, L]
    return _attend(q, k, v, mask, layer.scale, layer.softcap)[:, :, 0]


def _prefill_attention(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: PagedAttentionMetadata, index: int, layer: _Layer
) -> torch.Tensor:
    """One multi-token sequence: q ``[1, H, n, D]`` and its new key/value
    ``[1, KVH, n, D]`` -> ``[n, H, D]``."""
    seq = meta.prefills[index]
    fresh = seq.context_len == seq.query_len  # no earlier context: the new K/V are all of it
    if fresh:
        k, v = key, value
    else:
        k = _gather(layer.k_cache, seq.block_table[None])[:, :, : seq.context_len]  # [1, KVH, L, D]
        v = _gather(layer.v_cache, seq.block_table[None])[:, :, : seq.context_len]
    plain_causal = fresh and layer.window is None and layer.softcap is None
    mask = None if plain_causal else meta.prefill_mask(index, layer.window)  # [n, L]
    return _attend(q, k, v, mask, layer.scale, layer.softcap)[0].transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
