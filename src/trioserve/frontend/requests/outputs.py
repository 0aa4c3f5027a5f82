"""What a request's consumer receives, and the one-slot mailbox that holds it.

A ``RequestOutput`` is a delta: the text and token ids produced since the
consumer last took one. The mailbox (``OutputCollector``) holds at most one
pending output: when the consumer lags, new deltas are merged into it, so a
slow consumer costs a little memory per request and never stalls the output
handler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from trioserve.messages import SampleLogprobs


@dataclass
class RequestOutput:
    """One step of a request's life, as its consumer sees it.

    ``text`` and ``token_ids`` are what is new since the previous output;
    ``cumulative_text`` is all the text so far. ``finish_reason`` is set on the
    last output: ``"stop"`` (EOS, a stop token or a stop string; ``stop_reason``
    says which), ``"length"`` (``max_tokens`` or the context), or ``"abort"``.
    ``num_cached_tokens`` is how many prompt tokens the engine found in its
    prefix cache (and did not compute), known from the first token on; None
    before it (a request aborted before its first token never knows).
    ``prompt_logprobs`` (when the params ask for them) come with the first
    token: those of prompt tokens 1, 2... (the first prompt token has none).
    ``num_resumes`` is how many times the request was resumed so far after
    the engine core it ran on died (``EngineConfig.resume_requests``): its
    stream paused there, and went on where it stopped.
    """

    request_id: str
    text: str
    token_ids: list[int]
    cumulative_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[SampleLogprobs] | None = None
    index: int = 0  # which of a parent request's n samples (``Engine.stream_n``); 0 otherwise
    num_cached_tokens: int | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, with its last output
    num_resumes: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, newer: RequestOutput) -> None:
        """Fold a later delta into this one."""
        self.text += newer.text
        self.token_ids.extend(newer.token_ids)
        self.cumulative_text = newer.cumulative_text
        self.num_output_tokens = newer.num_output_tokens
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason
        self.num_cached_tokens = newer.num_cached_tokens
        if newer.logprobs is not None:
            self.logprobs = (self.logprobs or []) + newer.logprobs
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
        if newer.embedding is not None:
            self.embedding = newer.embedding
        self.num_resumes = newer.num_resumes


@dataclass(frozen=True)
class RequestMetrics:
    """What one request cost, for the metrics: handed to the engine's request
    observers when it ends (``finish_reason`` ``"stop"``, ``"length"``,
    ``"abort"`` or ``"error"``). Times are in seconds from its submission;
    ``inter_token_s`` holds one gap per engine output after the first,
    divided among the tokens that output brought."""

    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    time_to_first_token_s: float | None
    inter_token_s: tuple[float, ...]
    e2e_s: float
    engine_index: int = 0  # the engine (data parallel) it ran on
    queued_s: float | None = None  # waiting in the engine core to be scheduled (None: never scheduled)
    max_tokens: int = 0  # what it asked for
    num_resumes: int = 0  # times it was resumed after its engine core died (engine_index: where it ended)


@dataclass
class OutputCollector:
    """A request's mailbox: at most one pending (merged) output, or an error.
    ``on_ready``, when set, is called whenever something arrives (a parent
    request waits on all its children's mailboxes at once that way)."""

    _pending: RequestOutput | None = None
    _error: BaseException | None = None
    _ready: trio.Event = field(default_factory=trio.Event)
    on_ready: Callable[[], None] | None = None

    def put(self, output: RequestOutput) -> None:
        """Deliver an output; merges into the pending one if it was not taken."""
        if self._pending is None:
            self._pending = output
        else:
            self._pending.merge(output)
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``: the consumer's next ``get`` raises it
        (after taking any output still pending)."""
        if self._error is None:
            self._error = error
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def poll(self) -> RequestOutput | None:
        """The pending output, if any, without waiting; raises the error once
        no output is pending."""
        output, self._pending = self._pending, None
        if output is None and self._error is not None:
            raise self._error
        return output

    async def get(self) -> RequestOutput:
        """The next (merged) output. If cancelled, nothing is lost: the output
        stays pending for the next call."""
        while self._pending is None:
            if self._error is not None:
                raise self._error
            await self._ready.wait()
            self._ready = trio.Event()
        output, self._pending = self._pending, None
        return output
