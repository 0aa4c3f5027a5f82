"""Batched sampling from last-token logits.

Order of operations on each row of ``logits [B, V]``:

0. the row's own logits processing (``gpu/logits_processing.py``: logit
   bias, allowed tokens, bad words, min_tokens), for rows that ask for it;
1. penalties: repetition (HF style, over prompt and output tokens), then
   frequency and presence (OpenAI style, over output tokens);
2. greedy rows (temperature 0, or below ``GREEDY_BELOW``) take the argmax;
3. other rows: temperature, top-k, top-p, min-p, then one draw.

Every accepted value samples sensibly: logits made infinite by an extreme
penalty are clamped to the largest finite float (so no NaN comes out of a
softmax), the temperature divides logits shifted by their row's largest (so a
tiny one cannot overflow the top ones into a tie), and top-p always keeps the
most likely token, even when ``top_p`` rounds to 0 in float32.

A draw is ``argmax(probs / noise)`` with ``noise ~ Exponential(1)`` per
token, which picks token i with probability ``probs[i]``. For a request with
a seed, its noise comes from a generator seeded with a mix of the seed and
the position of the token being sampled (its index in prompt + output), so
its tokens depend only on the seed, the prompt and the model: not on the
rest of the batch, nor on preemption and re-prefill, nor on the request
being resumed on another engine core as a continuation (its earlier tokens
sent as output: the position counts them). Unseeded rows share the worker's
generator: a resumed unseeded request draws a valid sample, not the one it
would have drawn.

Logprobs are those of the model's own distribution (``log_softmax`` of the
raw logits, before logits processing, penalties, temperature and filters),
as vLLM reports by default; each with its rank in that distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trioserve.gpu.logits_processing import RowProcessors, apply_logits_processors
from trioserve.messages import SampleLogprobs
from trioserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def seed_for(seed: int, position: int) -> int:
    """A 64-bit generator seed mixing a request seed and a token position
    (splitmix64 finalizer, so that nearby inputs give unrelated seeds)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs for one step (one row per request that samples)."""

    params: list[SamplingParams]
    token_ids: list[Sequence[int]]  # prompt + output so far, per row
    num_prompt_tokens: list[int]
    processors: Sequence[RowProcessors | None] = ()  # per row (empty: no row processes its logits)

    @property
    def positions(self) -> list[int]:
        """Index, in prompt + output, of the token each row samples."""
        return [len(t) for t in self.token_ids]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None  # None when no row asked for logprobs


def _column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]  # [B, 1]


def _token_counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float: how often each token occurs in each row."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.tensor([list(r) + [vocab] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)  # the last column takes the padding
    counts.scatter_add_(1, padded.view(len(rows), width), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with +-inf clamped to the largest finite floats (-inf, a
    removed token, stays): what an extreme penalty or temperature overflows
    to must not become NaN in a softmax."""
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf")).clamp_(max=big)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties; ``logits [B, V]`` float32."""
    params, device, vocab = batch.params, logits.device, logits.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _token_counts(batch.token_ids, vocab, device) > 0  # [B, V]
        penalty = _column([p.repetition_penalty for p in params], logits.dtype, device)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        outputs = [t[n:] for t, n in zip(batch.token_ids, batch.num_prompt_tokens, strict=True)]
        counts = _token_counts(outputs, vocab, device)  # [B, V]
        frequency = _column([p.frequency_penalty for p in params], logits.dtype, device)
        presence = _column([p.presence_penalty for p in params], logits.dtype, device)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return _finite(logits)


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on ``logits [B, V]``; removed tokens get -inf. The
    result is the filtered distribution's logits shifted so that each row's largest is 0."""
    device, vocab = logits.device, logits.shape[1]
    temperature = _column([1.0 if p.greedy else p.temperature for p in params], logits.dtype, device)
    # Shifted by the row's largest logit first (a softmax is unchanged by it): a small temperature
    # then sends the others towards -inf instead of sending the top ones to +inf, tied there.
    top = logits.max(dim=1, keepdim=True).values
    logits = _finite((logits - top.clamp_min(torch.finfo(logits.dtype).min)) / temperature)
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top = logits.topk(max(ks), dim=1).values  # [B, max k], descending
        kth = top.gather(1, _column(ks, torch.long, device) - 1)  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = _column([p.top_p for p in params], logits.dtype, device)
        sorted_logits, order = logits.sort(dim=1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=1)
        mass_before = sorted_probs.cumsum(dim=1) - sorted_probs  # [B, V]
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False  # the first token always stays (a top_p that rounds to 0 too)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = _column([p.min_p for p in params], logits.dtype, device)
        probs = logits.softmax(dim=1)  # [B, V]
        logits = logits.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))
    return logits


def exponential_noise(
    batch: SamplingBatch, vocab: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``[B, V]`` Exponential(1) noise: per (seed, position) for seeded rows,
    from ``generator`` for the others."""
    noise = torch.empty(len(batch.params), vocab, device=device)
    unseeded = [i for i, p in enumerate(batch.params) if p.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=generator)
    for i, (p, position) in enumerate(zip(batch.params, batch.positions, strict=True)):
        if p.seed is not None:
            row_generator = torch.Generator(device=device).manual_seed(seed_for(p.seed, position))
            noise[i].exponential_(generator=row_generator)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]
) -> list[SampleLogprobs | None] | None:
    """Sampled token's logprob plus the top ``params.logprobs`` alternatives,
    from the raw ``logits [B, V]``."""
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return None
    top_n = max(n for n in wanted if n is not None)
    chosen, ranks, top_ids, top_values = token_logprobs(raw_logits, sampled, top_n)
    return [
        None if n is None else SampleLogprobs(chosen[i], top_ids[i][:n], top_values[i][:n], ranks[i])
        for i, n in enumerate(wanted)
    ]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """For each row of ``logits [N, V]``: the logprob of ``token_ids [N]``'s
    token, its rank (1: the most likely), and the ``top_n`` most likely
    tokens with their logprobs."""
    logprobs = logits.float().log_softmax(dim=1)  # [N, V]
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [N]
    top = logprobs.topk(top_n, dim=1)  # [N, top_n]
    return chosen[:, 0].tolist(), ranks.tolist(), top.indices.tolist(), top.values.tolist()


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> SamplerOutput:
    """One token per row of ``logits [B, V]`` (any float dtype), as the
    rows' ``SamplingParams`` ask."""
    raw = logits.float()  # [B, V]
    logits = raw
    if batch.processors:
        logits = apply_logits_processors(raw, batch.processors, batch.token_ids, batch.num_prompt_tokens)
    logits = apply_penalties(logits, batch)
    params = batch.params
    sampled = logits.argmax(dim=1)  # [B] greedy
    if not all(p.greedy for p in params):
        probs = apply_filters(logits, params).softmax(dim=1)  # [B, V]
        noise = exponential_noise(batch, logits.shape[1], generator, logits.device)
        drawn = (probs / noise).argmax(dim=1)  # [B]
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        sampled = torch.where(greedy, sampled, drawn)
    logprobs = compute_logprobs(raw, sampled, params)
    return SamplerOutput(sampled.tolist(), logprobs)
