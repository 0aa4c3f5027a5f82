"""Prompt logprobs: the logprob of each prompt token given the tokens before
it (``SamplingParams.prompt_logprobs``), from the logits of the positions a
step computes anyway.

The logits at position p predict token p + 1, so a slice ``[start, end)``
of a prompt of P tokens gives the logprobs of tokens ``start + 1`` to
``min(end, P - 1)``; the last prompt position predicts the first output
token, which the sampler takes. A prompt prefilled in chunks gives its
logprobs chunk by chunk, in order, and a request that asks for them
computes its whole prompt (the scheduler gives it no prefix-cache hit), so
every prompt token but the first gets one.

The model keeps those rows' logits besides the sampling rows'
(``logits_to_keep``); their ``log_softmax`` is taken ``PROMPT_LOGPROBS_ROWS``
rows at a time, which bounds the memory a long prompt chunk takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trioserve.gpu.sampler import token_logprobs
from trioserve.messages import PromptLogprobs, SampleLogprobs

PROMPT_LOGPROBS_ROWS = 1024


@dataclass(frozen=True)
class _Slice:
    req_id: str
    start: int  # the first prompt token it gives a logprob for
    count: int
    top_n: int


@dataclass
class PromptLogprobsPlan:
    """The prompt logprobs one step computes: which packed rows to keep,
    the token each predicts, and whose they are."""

    rows: list[int] = field(default_factory=list)  # packed index of each position giving a prompt logprob
    targets: list[int] = field(default_factory=list)  # the prompt token that position predicts
    slices: list[_Slice] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        top_n: int,
        start: int,
        end: int,
        packed_at: int,
    ) -> None:
        """The request's slice ``[start, end)`` of ``token_ids``, packed from index ``packed_at``."""
        last = min(end, num_prompt_tokens - 1)
        if last <= start:
            return
        self.rows.extend(range(packed_at, packed_at + last - start))
        self.targets.extend(token_ids[start + 1 : last + 1])
        self.slices.append(_Slice(req_id, start + 1, last - start, top_n))

    def compute(self, logits: torch.Tensor) -> list[PromptLogprobs] | None:
        """The logprobs, from the kept ``logits [len(rows), V]`` (None when the step computes none)."""
        if not self.slices:
            return None
        targets = torch.tensor(self.targets, dtype=torch.long, device=logits.device)  # [P]
        top_n = max(s.top_n for s in self.slices)
        entries: list[SampleLogprobs] = []
        for first in range(0, len(self.targets), PROMPT_LOGPROBS_ROWS):
            rows = slice(first, first + PROMPT_LOGPROBS_ROWS)
            chosen, ranks, top_ids, top_values = token_logprobs(logits[rows], targets[rows], top_n)
            entries.extend(map(SampleLogprobs, chosen, top_ids, top_values, ranks))
        out, offset = [], 0
        for s in self.slices:
            mine = entries[offset : offset + s.count]
            offset += s.count
            if s.top_n < top_n:
                mine = [
                    SampleLogprobs(e.logprob, e.top_token_ids[: s.top_n], e.top_logprobs[: s.top_n], e.rank)
                    for e in mine
                ]
            out.append(PromptLogprobs(s.req_id, s.start, mine))
        return out
