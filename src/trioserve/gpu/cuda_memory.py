"""The KV cache sized from a CUDA device's memory (``--gpu-memory-utilization``).

A worker may fill ``share`` of its device. Once the model is loaded, the
runner runs one profiling forward at the largest step the scheduler can send
(``max_num_batched_tokens`` tokens over up to ``max_num_seqs`` sequences, a
logit row each), over a temporary cache, and records the peak it allocated
beyond what was allocated before: the activations and logits of a full step.
The KV cache then takes what is left (``kv_budget_bytes``):

    share x total - (total - free) - activation peak

where ``total - free`` is what the device holds now (the weights, the CUDA
context, and anything another process put there). The decode graphs
(``gpu/decode_graphs.py``), captured after the cache, take their own memory
(stated in the worker's log).
"""

from __future__ import annotations

import torch

from trioserve.gpu.attention import DecodeKernel, PrefillKernel, build_metadata, step_metadata
from trioserve.gpu.compiled import Forward


def kv_budget_bytes(share: float, total: int, free: int, activation_peak: int) -> int:
    """Bytes the KV cache may take: ``share`` of ``total``, less what is in use
    now (``total - free``) and the activation peak of a full step (may be
    negative: nothing is left)."""
    if not 0 < share <= 1:
        raise ValueError(f"share: must be in (0, 1] (got {share})")
    if not 0 <= free <= total or activation_peak < 0:
        raise ValueError(f"free={free}, total={total}, activation_peak={activation_peak}: impossible")
    return int(share * total) - (total - free) - activation_peak


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the largest step: ``max_num_batched_tokens``
    tokens (at most ``max_model_len`` per sequence) over as many sequences as
    that needs and ``max_num_seqs`` allows, as even as can be."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    seqs = min(max_num_seqs, tokens)
    return [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]


@torch.inference_mode()
def activation_peak_bytes(
    forward: Forward,
    lengths: list[int],
    cache_shape: tuple[int, int, int, int],  # (layers, block_size, kv_heads, head_dim)
    dtype: torch.dtype,
    device: torch.device,
    decode_kernel: DecodeKernel | None,
    prefill_kernel: PrefillKernel | None,
) -> int:
    """The peak a forward over prompts of ``lengths`` allocates on CUDA
    ``device`` beyond what was allocated before it and its temporary cache."""
    layers, block_size, kv_heads, head_dim = cache_shape
    tables, first = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    pool = torch.zeros((layers, 2, first, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    caches = [(pool[i, 0], pool[i, 1]) for i in range(layers)]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    meta = build_metadata(
        lengths, lengths, tables, block_size, caches, device, decode_kernel=decode_kernel, prefill_kernel=prefill_kernel
    )
    input_ids = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    keep = torch.cumsum(torch.tensor(lengths, device=device), 0) - 1  # each sequence's last row
    with step_metadata(meta):
        forward(input_ids[None], meta.positions[None], keep)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del pool, caches, meta
    torch.cuda.empty_cache()
    return max(0, peak)
