"""Paged attention in Triton for the CUDA path: the cache read in place.

The portable path (``attention.py``) copies each sequence's K and V out of
the cache through its block table and runs SDPA over the copy. These kernels
read them where they lie, as a flash attention over the block table:

1. one program holds a tile of query rows, the query heads that share one KV
   head (grouped-query attention: query head h reads KV head h // G) of one
   or more query tokens of one sequence;
2. it walks that sequence's context in tiles of ``BLOCK_N`` tokens, each
   token's address found on its own (position n lies at offset n % bs of
   block ``block_table[n // bs]``), so the tile width does not depend on the
   block size and any block size from 1 to 128 works;
3. scores are scaled, softcapped where the model says so, masked (causal,
   and the sliding window), and folded into an online softmax in float32;
   the output is the weighted sum of V, divided out once at the end.

``decode_attention`` (one query token per sequence, the ``DecodeKernel`` of
``attention.py``) and ``prefill_attention`` (prefills and prefill chunks,
all sequences in one launch) are two launches of the same kernel.

Invariants: nothing here waits for the host. The grid and every constexpr
come from shapes and Python arguments only (never from tensor values), and
per-sequence lengths are read on the device, so a CUDA graph can capture
either launch. A program reads only the tokens its rows may see, and only
through its own block table's first ceil(context_len / bs) entries; it
writes only the rows of its own query tokens.

What a caller holds to: query, k_cache and v_cache share one dtype (float32,
float16 or bfloat16) and device; out may have any float dtype. query and out
may have any strides, and so may the caches (but the same for both) and the
block tables; block tables and lengths are long (int64: block ids scale cache
offsets), and the 1-D ones contiguous. Float32 tiles multiply in IEEE float32
(no TF32), as torch's matmul does by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

MIN_DOT = 16  # the smallest tile side tl.dot takes on a GPU


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    """tanh through exp of a non-positive number: no overflow, no NaN for any finite x."""
    e = tl.exp(-2.0 * tl.where(x >= 0, x, -x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    query,  # [1, H, T, D]
    k_cache,  # [N, bs, KVH, D]
    v_cache,  # same shape and strides as k_cache
    out,  # [T, H, D]
    block_tables,  # [S, nb] long
    query_starts,  # [S] long: packed row of each sequence's first query token
    query_lens,  # [S] long (unread when IS_DECODE: one token each)
    context_lens,  # [S] long
    scale,
    window,
    softcap,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bs,
    stride_bb,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    GROUP_PAD: tl.constexpr,  # rows per query token: GROUP padded to a power of two
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    context_len = tl.load(context_lens + seq)
    query_start = tl.load(query_starts + seq)
    if IS_DECODE:
        query_len = 1
    else:
        query_len = tl.load(query_lens + seq)
        if q_tile * BLOCK_Q >= query_len:
            return

    # Rows: BLOCK_Q query tokens x GROUP_PAD heads, token-major.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD  # [M]: index among the sequence's query tokens
    head = kv_head * GROUP + rows % GROUP_PAD  # [M]
    row_ok = (rows % GROUP_PAD < GROUP) & (token < query_len)
    pos = context_len - query_len + token  # [M]: each row's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (query_start + token) * stride_qt + head * stride_qh
    q = tl.load(
        query + q_rows[:, None] + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )  # [M, BLOCK_D]

    # The tokens any row of this tile sees: [start, end).
    first = context_len - query_len + q_tile * BLOCK_Q
    end = tl.minimum(first + BLOCK_Q, context_len)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(first - window + 1, 0)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, tl.float32)  # finite: a row masked so far stays NaN-free
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        n_ok = n < end
        block = tl.load(block_tables + seq * stride_bs + (n // BLOCK_SIZE) * stride_bb, mask=n_ok, other=0)
        slot = block * stride_kn + (n % BLOCK_SIZE) * stride_kb + kv_head * stride_kh  # [BLOCK_N] int64
        k = tl.load(
            k_cache + slot[None, :] + dims[:, None] * stride_kd, mask=dim_ok[:, None] & n_ok[None, :], other=0.0
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision="ieee") * scale  # [M, BLOCK_N]
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache + slot[:, None] + dims[None, :] * stride_kd, mask=n_ok[:, None] & dim_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (query_start + token) * stride_ot + head * stride_oh
    tl.store(
        out + o_rows[:, None] + dims[None, :] * stride_od,
        acc.to(out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def decode_attention(
    query: torch.Tensor,  # [1, H, T, D]
    k_cache: torch.Tensor,  # [N, bs, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, nb] long
    context_lens: torch.Tensor,  # [B] long
    token_index: torch.Tensor,  # [B] long: the rows of query and out
    out: torch.Tensor,  # [T, H, D]: rows token_index written
    scale: float,
    window: int | None,
    softcap: float | None,
    shared_len: int,
) -> None:
    """One query token per sequence, the last of its context: ``attention.DecodeKernel``.
    One program per (sequence, KV head) holds that head's group of query
    heads. ``shared_len`` is ignored: every sequence reads all its blocks."""
    _launch(
        query, k_cache, v_cache, out, block_tables, token_index, None, context_lens,
        scale, window, softcap, max_query_len=1,
    )  # fmt: skip


def prefill_attention(
    query: torch.Tensor,  # [1, H, T, D]
    k_cache: torch.Tensor,  # [N, bs, KVH, D]: the queries' own K/V already written
    v_cache: torch.Tensor,
    query_starts: torch.Tensor,  # [S] long: packed row of each sequence's first query token
    query_lens: torch.Tensor,  # [S] long
    context_lens: torch.Tensor,  # [S] long: tokens in the cache, new ones included
    block_tables: torch.Tensor,  # [S, nb] long
    out: torch.Tensor,  # [T, H, D]: the queries' rows written
    scale: float,
    window: int | None,
    softcap: float | None,
    max_query_len: int,
) -> None:
    """Several query tokens per sequence, the last ``query_lens[s]`` of its
    ``context_lens[s]``, all sequences in one launch. ``max_query_len`` (at
    least every ``query_lens[s]``) sizes the grid; programs past a sequence's
    queries return at once."""
    _launch(
        query, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens,
        scale, window, softcap, max_query_len,
    )  # fmt: skip


@dataclass(frozen=True)
class _Tiles:
    """A launch's tile shape: ``rows = block_q * group_pad`` query rows against
    ``block_n`` tokens of ``block_d`` dims.

    Chosen by registers, read off ptxas for sm_90 (bfloat16; no GPU timed
    them): the gathered K/V tiles hold one 64-bit address per element, so
    the tiles that fit have 8 warps, at most 64 rows, and half the tokens at
    head dim 256 (32 rows there), where 4 warps or wider tiles spill.
    """

    block_q: int  # query tokens per program
    group_pad: int  # rows per query token: the group of heads, padded
    block_d: int
    block_n: int
    num_warps: int

    @classmethod
    def choose(cls, group: int, head_dim: int, decode: bool) -> _Tiles:
        block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
        group_pad = triton.next_power_of_2(group)
        if decode:
            group_pad = max(group_pad, MIN_DOT)  # one token: its heads alone fill the rows
            block_q = 1
        else:
            block_q = max(1, (64 if block_d <= 128 else 32) // group_pad)
        rows = block_q * group_pad
        return cls(block_q, group_pad, block_d, 32 if block_d <= 128 else 16, 4 if rows * block_d <= 1024 else 8)


def _launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor | None,  # None: decodes, one token each
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    max_query_len: int,
) -> None:
    _, heads, _, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of the cache's KV heads ({kv_heads})")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    tiles = _Tiles.choose(heads // kv_heads, head_dim, decode=query_lens is None)
    grid = (context_lens.shape[0], kv_heads, triton.cdiv(max_query_len, tiles.block_q))
    if 0 in grid:
        return
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, query_starts,
        context_lens if query_lens is None else query_lens, context_lens,
        scale, 0 if window is None else window, 1.0 if softcap is None else softcap,
        query.stride(1), query.stride(2), query.stride(3),
        *k_cache.stride(), *out.stride(), *block_tables.stride(),
        HEAD_DIM=head_dim, GROUP=heads // kv_heads, BLOCK_SIZE=block_size,
        BLOCK_Q=tiles.block_q, GROUP_PAD=tiles.group_pad, BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n,
        IS_DECODE=query_lens is None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        num_warps=tiles.num_warps,
    )  # fmt: skip
