"""Per-row logits processing: what a request asks of its logits before any
sampling parameter sees them (``SamplingParams``: ``logit_bias``,
``allowed_token_ids``, ``bad_words_token_ids``, ``min_tokens``).

It is one stage of the sampler (``gpu/sampler.py``): after the model's
logits (and any structured-output bitmask, another such stage), before
penalties, temperature, top-k and top-p; greedy and sampled rows alike. Its
work for a step, on ``logits [B, V]``:

1. ``logit_bias``: added, as one sparse ``index_put_`` over every row's
   (row, token, bias) triples;
2. bans, as one boolean ``[B, V]`` mask filled with -inf: every token but
   ``allowed_token_ids`` (when given); the last token of a bad word whose
   other tokens end the output so far (a one-token word always); and, while
   the output holds fewer than ``min_tokens`` tokens, the stop token ids and
   (unless ``ignore_eos``) EOS.

A request's part is built once, when the worker first sees it
(``RowProcessors.build``: its ids and biases as tensors on the device), so a
step only concatenates the rows' tensors: a few operations per step, none
per vocabulary entry. Rows that ask for none of this are ``None`` and cost
nothing; a step where every row is ``None`` returns the logits untouched.
Token ids are inside the vocabulary (the front-end checks them; ``build``
checks again, since an index out of range would crash the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trioserve.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class RowProcessors:
    """One request's logits processing, on the device."""

    bias_ids: torch.Tensor | None  # [K] long
    bias_values: torch.Tensor | None  # [K] float32
    allowed_ids: torch.Tensor | None  # [A] long
    stop_ids: torch.Tensor | None  # [S] long: banned while the output is shorter than min_tokens
    min_tokens: int
    bad_words: tuple[tuple[int, ...], ...]

    @classmethod
    def build(
        cls, params: SamplingParams, eos_token_ids: Sequence[int], vocab_size: int, device: torch.device
    ) -> RowProcessors | None:
        """The processing ``params`` ask for, or None when they ask for none.
        Raises ``ValueError`` naming the field of a token id outside the vocabulary."""
        if not params.processes_logits:
            return None
        for name, ids in (
            ("logit_bias", list(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word]),
        ):
            if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
                raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
        bias_ids = bias_values = allowed = stop = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.long, device=device)
        if params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            in_vocab = sorted(t for t in stops if t < vocab_size)  # a stop id past the vocabulary is never sampled
            stop = torch.tensor(in_vocab, dtype=torch.long, device=device) if in_vocab else None
        words = tuple(tuple(word) for word in params.bad_words_token_ids)
        return cls(bias_ids, bias_values, allowed, stop, params.min_tokens, words)

    def banned_by_bad_words(self, token_ids: Sequence[int], num_outputs: int) -> list[int]:
        """The tokens that would complete a bad word after ``token_ids``,
        whose last ``num_outputs`` are the output so far (a bad word's other
        tokens must all be output tokens)."""
        banned = []
        for word in self.bad_words:
            prefix_len = len(word) - 1
            if prefix_len == 0 or (num_outputs >= prefix_len and tuple(token_ids[-prefix_len:]) == word[:-1]):
                banned.append(word[-1])
        return banned


def apply_logits_processors(
    logits: torch.Tensor,
    rows: Sequence[RowProcessors | None],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """``logits [B, V]`` (float32) processed as each row asks (``rows``, one
    per row; ``token_ids``: each row's prompt and output so far, of which
    the first ``num_prompt_tokens`` are the prompt). A new tensor when any
    row asks for something; ``logits`` itself otherwise."""
    if not any(r is not None for r in rows):
        return logits
    device, (num_rows, vocab) = logits.device, logits.shape
    logits = _add_biases(logits.clone(), rows)
    num_outputs = [len(t) - n for t, n in zip(token_ids, num_prompt_tokens, strict=True)]
    banned = _banned(rows, token_ids, num_outputs, num_rows, vocab, device)
    return logits if banned is None else logits.masked_fill(banned, float("-inf"))


def _row_index(row: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, row, dtype=torch.long, device=like.device)


def _add_biases(logits: torch.Tensor, rows: Sequence[RowProcessors | None]) -> torch.Tensor:
    biased = [(i, r) for i, r in enumerate(rows) if r is not None and r.bias_ids is not None]
    if not biased:
        return logits
    row_index = torch.cat([_row_index(i, r.bias_ids) for i, r in biased])  # type: ignore[arg-type]
    ids = torch.cat([r.bias_ids for _, r in biased])  # type: ignore[misc]
    values = torch.cat([r.bias_values for _, r in biased])  # type: ignore[misc]
    return logits.index_put_((row_index, ids), values.to(logits.dtype), accumulate=True)


def _banned(
    rows: Sequence[RowProcessors | None],
    token_ids: Sequence[Sequence[int]],
    num_outputs: Sequence[int],
    num_rows: int,
    vocab: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``[B, V]`` bool, True where a token is banned; None when none is."""
    allowed_rows: list[int] = []
    allowed_parts: list[torch.Tensor] = []
    ban_parts: list[torch.Tensor] = []
    ban_rows: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        if r is None:
            continue
        if r.allowed_ids is not None:
            allowed_rows.append(i)
            allowed_parts.append(r.allowed_ids)
        if r.stop_ids is not None and num_outputs[i] < r.min_tokens:
            ban_parts.append(r.stop_ids)
            ban_rows.append(_row_index(i, r.stop_ids))
        if r.bad_words and (words := r.banned_by_bad_words(token_ids[i], num_outputs[i])):
            ban_parts.append(torch.tensor(words, dtype=torch.long, device=device))
            ban_rows.append(torch.full((len(words),), i, dtype=torch.long, device=device))
    if not allowed_rows and not ban_parts:
        return None
    banned = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    if allowed_rows:
        banned[allowed_rows] = True
        row_index = torch.cat([_row_index(i, ids) for i, ids in zip(allowed_rows, allowed_parts, strict=True)])
        banned.index_put_((row_index, torch.cat(allowed_parts)), torch.tensor(False, device=device))
    if ban_parts:
        banned.index_put_((torch.cat(ban_rows), torch.cat(ban_parts)), torch.tensor(True, device=device))
    return banned
