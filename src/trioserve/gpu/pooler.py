"""Embedding requests in the worker: the rows of a step's hidden states that
each pools, and its vector once its prompt is computed (``trioserve.pooling``).

An embedding engine loads the model without its language-model head
(``AutoModel``; an encoder of BERT's family with transformers' own attention,
run on whole prompts in a padded batch: ``encoder_hidden``) and keeps, of each step's hidden states, only the rows its
requests pool: a ``"last"`` request its last prompt token's row, in the step
that completes its prompt; ``"cls"`` its first token's, in the step that
computes it; ``"mean"`` every row of every slice, summed across the slices of
a prompt prefilled in chunks (the sums live in ``Pooler`` until the prompt
is done, and are dropped with the request). A step that completes a prompt
gives that request's vector: pooled, cut to ``dimensions``, normalised when
asked, in float32 little-endian bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from trioserve.gpu.compiled import Forward
from trioserve.pooling import PoolingParams

PADDING_SLACK = 1.25  # a padded batch of an encoder's prompts computes at most this many times their tokens


def encoder_hidden(model: torch.nn.Module, input_ids: list[int], lengths: list[int]) -> torch.Tensor:
    """An encoder's last hidden states of whole prompts packed one after
    another (``lengths`` each), run as padded batches with their attention
    masks (both ways, no KV cache): ``[sum(lengths), H]``, packed alike. The
    prompts are grouped by length, so that padding costs at most
    ``PADDING_SLACK`` times the tokens (a step's prompts come in any order)."""
    device = next(model.parameters()).device
    packed = torch.tensor(input_ids, dtype=torch.long, device=device)
    starts = list(itertools.accumulate([0, *lengths]))[:-1]
    out: torch.Tensor | None = None
    for group in _by_length(lengths):
        longest = max(lengths[i] for i in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long, device=device)
        mask = torch.zeros(len(group), longest, dtype=torch.long, device=device)
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = packed[starts[i] : starts[i] + lengths[i]]
            mask[row, : lengths[i]] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
        if out is None:
            out = hidden.new_empty(len(input_ids), hidden.shape[-1])
        for row, i in enumerate(group):
            out[starts[i] : starts[i] + lengths[i]] = hidden[row, : lengths[i]]
    assert out is not None  # a step has at least one prompt
    return out


def _by_length(lengths: list[int]) -> list[list[int]]:
    """The prompts' indices in groups of similar length (shortest first):
    each group padded to its longest computes at most ``PADDING_SLACK`` times
    its tokens."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and lengths[i] * (len(groups[-1]) + 1) <= PADDING_SLACK * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def hidden_forward(model: torch.nn.Module) -> Forward:
    """The base model called as it is: the last layer's hidden states of the kept rows, ``[R, H]``."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state[0].index_select(0, rows)

    return forward


@dataclass(frozen=True)
class _Pooled:
    req_id: str
    params: PoolingParams
    first_row: int  # among the kept rows
    num_rows: int
    done: bool  # the step completes the prompt


@dataclass
class PoolingPlan:
    """One step's pooling rows: ``rows`` (packed indices to keep, in order)
    and, per request, which of them are its own."""

    rows: list[int] = field(default_factory=list)
    requests: list[_Pooled] = field(default_factory=list)

    def add(self, req_id: str, params: PoolingParams, start: int, end: int, num_prompt: int, packed_at: int) -> None:
        """Request ``req_id`` computes prompt tokens ``[start, end)``, packed from ``packed_at``."""
        if params.whole and (start, end) != (0, num_prompt):
            raise ValueError(f"num_scheduled_tokens[{req_id!r}]: an encoder's prompt must be computed whole")
        first = len(self.rows)
        if params.type == "mean":
            self.rows.extend(range(packed_at, packed_at + end - start))
        elif params.type == "cls" and start == 0:
            self.rows.append(packed_at)
        elif params.type == "last" and end == num_prompt:
            self.rows.append(packed_at + end - start - 1)
        self.requests.append(_Pooled(req_id, params, first, len(self.rows) - first, end == num_prompt))


class Pooler:
    """What the worker keeps between steps: each chunked prompt's pooled sum so far."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}  # req_id: (sum of rows, count), float32

    def forget(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    def pool(self, plan: PoolingPlan, hidden: torch.Tensor) -> dict[str, bytes]:
        """The vectors of the requests whose prompt ``plan``'s step completed,
        from its kept rows' hidden states ``[len(plan.rows), H]``."""
        vectors = {}
        for req in plan.requests:
            rows = hidden[req.first_row : req.first_row + req.num_rows].float()
            total, count = self._partial.pop(req.req_id, (None, 0))
            if req.num_rows:
                summed = rows.sum(0)
                total, count = (summed if total is None else total + summed), count + req.num_rows
            if not req.done:
                if total is not None:
                    self._partial[req.req_id] = (total, count)
                continue
            if total is None:
                raise RuntimeError(f"pooling: request {req.req_id!r} completed its prompt with no row to pool")
            vectors[req.req_id] = _finish(total / count, req.params)
        return vectors


def _finish(vector: torch.Tensor, params: PoolingParams) -> bytes:
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.to(torch.float32).cpu().numpy().astype("<f4").tobytes()
