"""One generation request as the engine core tracks it.

Invariants:
- ``all_token_ids == prompt_token_ids + output_token_ids``; the prompt never
  changes, and output tokens are only ever appended.
- ``0 <= num_computed_tokens <= num_tokens + num_pending``: the first
  ``num_computed_tokens`` tokens have their keys and values in the KV cache
  (while RUNNING), or will once the steps in flight have run. After a
  preemption it is 0 again: everything is recomputed.
- ``num_pending`` counts the tokens being sampled for it in steps that are
  still in flight (the scheduler plans a step before the previous one has
  returned). The workers already hold ``num_tokens + num_pending`` tokens of
  it, or will when those steps have run: they append what they sample.
- ``finish_reason`` is set exactly when ``status`` is FINISHED, and a
  finished request never changes again.
- ``block_hashes[i]`` is the chained hash of its ``i``-th block of known
  tokens (prefix caching: ``core/block_hash.py``); the list only grows.
  ``num_cached_tokens`` is -1 until it is first admitted, then the number
  of its prompt tokens found in the prefix cache then; it never changes again.
- A request with a structured-output constraint (``params.structured``)
  waits in WAITING_FOR_GRAMMAR, holding nothing, until the engine core gives
  it its ``constraint``; from then on the constraint has accepted exactly
  its output tokens, in order (preemption keeps them all, so it keeps its
  state too).
- ``prompt_logprobs`` (when its params ask for them) holds those of prompt
  tokens 1, 2... in order, without a gap, until its first output token
  takes them all away.
- A continuation (a request resumed after the engine core it ran on died)
  starts with the output tokens it had generated there: they are output
  like any other (penalties, ``min_tokens``, ``max_tokens``, stop tokens,
  the position a seeded draw is made at), and its constraint accepts them
  before it samples under it.

Only the scheduler mutates a request; everyone else reads.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Protocol

from trioserve.core.block_hash import BlockHash
from trioserve.core.block_manager import cdiv
from trioserve.messages import FinishReason, SampleLogprobs
from trioserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = enum.auto()  # its constraint is being compiled: not queued yet
    WAITING = enum.auto()  # queued: new, or preempted and waiting to be recomputed
    RUNNING = enum.auto()  # holds KV blocks; the workers hold its state
    FINISHED = enum.auto()  # stopped, hit a length limit, or aborted


class TokenConstraint(Protocol):
    """A request's structured-output state, as the scheduler uses it (the
    engine core's grammar matcher satisfies it)."""

    def accept(self, token_id: int) -> bool:
        """Move past ``token_id``; False if the constraint does not allow it."""
        ...

    def is_complete(self) -> bool:
        """The constraint is satisfied and allows nothing more."""
        ...


class Request:
    """A prompt, its sampling parameters, and what has been generated so far."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        client_id: str = "",
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """``output_token_ids``: a continuation's tokens generated so far (``AddRequest.output_token_ids``)."""
        self.request_id = request_id
        self.client_id = client_id  # whose request: waiting requests are admitted by client in turn
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids)
        self.num_resumed_tokens = len(self.output_token_ids)  # a continuation's: generated before it came here
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens being sampled in steps in flight
        self.constraint: TokenConstraint | None = None
        self.status = RequestStatus.WAITING_FOR_GRAMMAR if params.structured is not None else RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_hashes: list[BlockHash] = []  # of its full blocks of known tokens, when caching
        self.lora_key = b""  # its LoRA adapter's (core/lora.py), in its blocks' hashes; empty: the base model
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache at its first admission
        self.arrived_at = time.monotonic()
        self.queued_s: float | None = None  # from its arrival to its first admission
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self.prompt_logprobs: list[SampleLogprobs] = []  # of prompt tokens 1, 2... so far

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, pending={self.num_pending})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens, as a new list."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_can_run(self, max_model_len: int, num_blocks: int, block_size: int, step_tokens: int) -> None:
        """Raise ``ValueError`` naming the field if this new request could never
        run: it has run already, or its prompt is empty, holds a bad token id,
        leaves no room to generate, needs more than the whole KV cache, or
        (an encoder's, computed whole) more than a step's ``step_tokens``; or,
        a continuation, its tokens so far are bad, already end it, or with
        the prompt leave no room or need more than the whole KV cache."""
        fresh = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)
        if self.status not in fresh or self.num_output_tokens != self.num_resumed_tokens:
            raise ValueError(f"request: {self.request_id!r} has already run")
        num_prompt = self.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("prompt: must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt: token ids must be non-negative integers")
        if self.output_token_ids:
            self._check_continuation(max_model_len, num_blocks * block_size)
        if self.params.pooling is not None and num_prompt > max_model_len:
            raise ValueError(f"prompt: {num_prompt} tokens are more than max_model_len={max_model_len}")
        if self.params.pooling is not None and self.params.pooling.whole and num_prompt > step_tokens:
            raise ValueError(
                f"prompt: {num_prompt} tokens are more than a step computes (max_num_batched_tokens={step_tokens}), "
                "and an encoder's prompt is computed in one step"
            )
        if self.params.pooling is None and num_prompt >= max_model_len:
            raise ValueError(
                f"prompt: {num_prompt} tokens leave no room to generate within max_model_len={max_model_len}"
            )
        if num_prompt > num_blocks * block_size:
            raise ValueError(
                f"prompt: {num_prompt} tokens need {cdiv(num_prompt, block_size)} KV blocks, "
                f"but the cache holds only {num_blocks} (of {block_size} tokens)"
            )

    def _check_continuation(self, max_model_len: int, cache_tokens: int) -> None:
        """A continuation's tokens so far: valid ids that leave it unfinished and fit."""
        if self.params.pooling is not None:
            raise ValueError("output_token_ids: an embedding request generates no tokens")
        if any(not isinstance(t, int) or t < 0 for t in self.output_token_ids):
            raise ValueError("output_token_ids: token ids must be non-negative integers")
        if self.num_tokens >= max_model_len:
            raise ValueError(
                f"output_token_ids: the prompt and {self.num_output_tokens} tokens so far ({self.num_tokens}) "
                f"leave no room to generate within max_model_len={max_model_len}"
            )
        if self.num_tokens > cache_tokens:
            raise ValueError(
                f"output_token_ids: the prompt and {self.num_output_tokens} tokens so far ({self.num_tokens}) "
                f"are more than the KV cache holds ({cache_tokens} tokens)"
            )
        if (reason := self.stop_reason(max_model_len)) is not None:
            raise ValueError(f"output_token_ids: the tokens so far already end the request ({reason})")

    def replay(self, constraint: TokenConstraint) -> str | None:
        """Move a new ``constraint`` past the tokens generated so far (a
        continuation's); why it refuses one, or None."""
        for i, token_id in enumerate(self.output_token_ids):
            if not constraint.accept(token_id):
                return f"output_token_ids: its constraint refuses token {token_id} (at index {i})"
        if self.output_token_ids and constraint.is_complete():
            return "output_token_ids: the tokens so far already complete its constraint"
        return None

    def append_output_token(self, token_id: int) -> bool:
        """Append a sampled token; False if the request's constraint refused it."""
        self.output_token_ids.append(token_id)
        return self.constraint is None or self.constraint.accept(token_id)

    def stop_reason(self, max_model_len: int) -> FinishReason | None:
        """Why the request must stop after its last output token, or None.

        Checked in order: EOS (unless ``ignore_eos``), a stop token id (those
        two only once it has more than ``min_tokens`` output tokens), its
        constraint complete, ``max_tokens`` output tokens, ``max_model_len``
        tokens in all.
        """
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens > self.params.min_tokens:
            if last in self.eos_token_ids and not self.params.ignore_eos:
                return "stop"
            if last in self._stop_token_ids:
                return "stop"
        if self.constraint is not None and self.constraint.is_complete():
            return "stop"
        if self.reaches_length_limit(max_model_len):
            return "length"
        return None

    def reaches_length_limit(self, max_model_len: int, num_more: int = 0) -> bool:
        """With ``num_more`` tokens beyond those it has, it would have
        ``max_tokens`` output tokens or ``max_model_len`` tokens in all."""
        num_tokens = self.num_tokens + num_more
        return num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= max_model_len

    def add_prompt_logprobs(self, start: int, logprobs: list[SampleLogprobs]) -> None:
        """Take the logprobs of prompt tokens ``start``, ``start + 1``... (a
        step's slice), keeping those it does not have yet: a prompt computed
        again after a preemption gives them again."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token without one
        if start <= have < start + len(logprobs):
            self.prompt_logprobs.extend(logprobs[have - start :])

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
