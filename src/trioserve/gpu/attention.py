"""Paged attention for transformers models, registered as ``"trioserve_paged"``.

One model call runs a packed batch: ``input_ids [1, T]`` holds several
sequences back to back. Each layer's attention call

1. writes the new keys and values into that layer's paged cache, flat-indexed
   by ``slot_mapping`` (slot = block_id * block_size + offset in block);
2. attends every query token of a sequence to that sequence's context read
   back through its block table: the token at position p sees positions
   <= p (and > p - sliding_window on sliding layers).

Sequences with one new token (decodes) share one padded SDPA call with a
length mask; multi-token sequences (prefills, prefill chunks) get one call
each. Everything the layers need is built once per step by
``build_metadata`` and reaches the attention function unchanged through the
``trioserve_metadata`` keyword of ``model(...)``.

Invariants: cache tensors are ``[num_blocks, block_size, KVH, D]`` and hold
only finite values (padding reads are masked, never NaN); a sequence's block
table covers its whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "trioserve_paged"
METADATA_KWARG = "trioserve_metadata"

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [N, bs, KVH, D]


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with several new tokens: its slice of the packed batch."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step, new ones included
    block_table: torch.Tensor  # [ceil(context_len / bs)] long, on device


@dataclass
class PagedAttentionMetadata:
    """One step's view of the paged cache, shared by every layer."""

    kv_caches: KVCache
    block_size: int
    positions: torch.Tensor  # [T] long: position of each packed token in its sequence
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each packed token
    decode_token_index: torch.Tensor | None  # [B] long: packed row of each decode's token
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long, 0-padded
    decode_context_lens: torch.Tensor | None  # [B] long
    prefills: list[PrefillSeq]
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built by the first layer

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, L]`` bool: True where a decode token may attend."""
        key = ("decode", window)
        if key not in self._masks:
            lens = self.decode_context_lens  # [B]
            kv_pos = torch.arange(self.decode_block_tables.shape[1] * self.block_size, device=lens.device)
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
) -> PagedAttentionMetadata:
    """Metadata for a packed batch of sequences, in packing order.

    Sequence i contributes ``query_lens[i]`` tokens, the last ones of its
    ``context_lens[i]``; ``block_tables[i]`` must cover ``context_lens[i]``.
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

    decode_index, decode_tables, decode_lens = _decode_rows(q_lens, ctx_lens, starts, table, block_size)
    prefills = [
        PrefillSeq(
            int(starts[i]), n, context_lens[i], _used_blocks(block_tables[i], context_lens[i], block_size, device)
        )
        for i, n in enumerate(query_lens)
        if n > 1
    ]
    return PagedAttentionMetadata(
        kv_caches=kv_caches,
        block_size=block_size,
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        decode_token_index=_to(decode_index, device),
        decode_block_tables=_to(decode_tables, device),
        decode_context_lens=_to(decode_lens, device),
        prefills=prefills,
    )


def _decode_rows(
    q_lens: torch.Tensor, ctx_lens: torch.Tensor, starts: torch.Tensor, table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Packed row ``[B]``, block table ``[B, nb]`` and context length ``[B]``
    of the one-token sequences (None when there are none), on the CPU."""
    is_decode = q_lens == 1  # [S]
    if not bool(is_decode.any()):
        return None, None, None
    lens = ctx_lens[is_decode]  # [B]
    width = -(-int(lens.max()) // block_size)
    return starts[is_decode], table[is_decode, :width], lens


def _used_blocks(blocks: list[int], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The blocks holding the first ``context_len`` tokens: ``[ceil(context_len / bs)]``."""
    return torch.tensor(blocks[: -(-context_len // block_size)], dtype=torch.long, device=device)


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


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


def paged_attention_forward(
    module: torch.nn.Module,
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
    masks come from the metadata.
    """
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, PagedAttentionMetadata):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs model(..., {METADATA_KWARG}=PagedAttentionMetadata)")
    scale = module.scaling if scaling is None else scaling
    layer = _Layer(*meta.kv_caches[module.layer_idx], scale, sliding_window, softcap)
    # New K/V: [1, KVH, T, D] -> [T, KVH, D], into their slots.
    _, kv_heads, _, head_dim = key.shape
    layer.k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    layer.v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    if meta.decode_token_index is not None:
        out[meta.decode_token_index] = _decode_attention(query, meta, layer)
    for i, seq in enumerate(meta.prefills):
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = _prefill_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows], meta, i, layer)
    return out[None], None


@dataclass(frozen=True)
class _Layer:
    """What one layer's call brings: its cache and its attention details."""

    k_cache: torch.Tensor  # [N, bs, KVH, D]
    v_cache: torch.Tensor
    scale: float
    window: int | None
    softcap: float | None


def _decode_attention(query: torch.Tensor, meta: PagedAttentionMetadata, layer: _Layer) -> torch.Tensor:
    """All one-token sequences in one padded call: -> ``[B, H, D]``."""
    q = query[0][:, meta.decode_token_index].transpose(0, 1)[:, :, None]  # [B, H, 1, D]
    k = _gather(layer.k_cache, meta.decode_block_tables)  # [B, KVH, L, D]
    v = _gather(layer.v_cache, meta.decode_block_tables)
    mask = meta.decode_mask(layer.window)  # [B, 1, 1, L]
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
