"""One request as the front-end tracks it: its detokenizer and its mailbox,
and where it runs.

A request is on one engine core at a time (``client``, set once it is
queued for it). When that engine core dies, the request may be resumed on
another (``frontend/engines/resume.py``): it is sent again as a
continuation of every token it received (``output_token_ids``), and its
detokenizer, stop strings and mailbox carry on as they were, so that its
consumer sees one stream. ``aborted`` is set once its consumer is done with
it, wherever it is then.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from trioserve.frontend.requests.outputs import OutputCollector, RequestMetrics, RequestOutput
from trioserve.frontend.text.detokenizer import IncrementalDetokenizer
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import AddRequest, TokenOutput
from trioserve.sampling_params import SamplingParams


class EngineCore(Protocol):
    """The engine core a request is on, as the request sees it (its client)."""

    def abort(self, request_id: str) -> None: ...


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        client_id: str = "",
        index: int = 0,
        on_end: Callable[[RequestMetrics], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index  # among a parent request's samples
        self.client_id = client_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        # A stop token id or EOS that ends the request leaves its text out, unless asked for.
        self._stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.collector = OutputCollector()
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens from the prefix cache, from the first token on
        self.queued_s: float | None = None  # how long the engine core kept it waiting, from the first token on
        self.finished = False
        self._on_end = on_end  # told once, when the request ends
        self.engine_index = 0  # the engine it was submitted to (data parallel); after a resumption, the new one
        self.target: int | None = None  # the engine it must run on (Engine.stream's engine_index), or None: any
        self.client: EngineCore | None = None  # the engine core it is queued for or runs on; None meanwhile
        self.output_token_ids: list[int] = []  # every token received: a continuation's context
        self.num_resumes = 0
        self.aborted = False  # its consumer is done with it (it left early, or the request failed)
        self._started = time.monotonic()
        self._first_token_at: float | None = None
        self._last_output_at = 0.0
        self._inter_token_s: list[float] = []

    def add_request(self, wave: int = 0) -> AddRequest:
        """The message that runs it: a continuation of its tokens so far once
        it has some (its prompt logprobs came with the first of them)."""
        params = self.params
        if self.output_token_ids and params.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        return AddRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=params,
            client_id=self.client_id,
            wave=wave,
            output_token_ids=list(self.output_token_ids),
        )

    def abort(self) -> None:
        """Its consumer is done with it: abort it in the engine core it is on
        (while it is being queued or resumed, that is done when it gets
        there, or it is not resumed). Never blocks."""
        self.aborted = True
        if self.client is not None:
            self.client.abort(self.request_id)

    def process(self, output: TokenOutput) -> bool:
        """Turn an engine output into a delta for the consumer. Returns True when
        a stop string ended the request here (the engine must be told)."""
        self._time(len(output.new_token_ids))
        self.num_output_tokens += len(output.new_token_ids)
        self.output_token_ids += output.new_token_ids
        if output.num_cached_tokens is not None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.queued_s is not None:
            self.queued_s = output.queued_s
        finish_reason = output.finish_reason
        shown = output.new_token_ids
        if (
            finish_reason == "stop"
            and shown
            and shown[-1] in self._stop_token_ids
            and not self.params.include_stop_str_in_output
        ):
            shown = shown[:-1]
        update = self.detokenizer.update(shown)
        text = update.text_delta
        stop_reason: str | int | None = None
        if update.stop_string is not None:
            finish_reason, stop_reason = "stop", update.stop_string
        elif finish_reason is not None:
            text += self.detokenizer.flush()
            last = output.new_token_ids[-1] if output.new_token_ids else None
            if self.detokenizer.stop_string is not None and finish_reason in ("length", "stop"):
                # The text held back until now completed a stop string: it ends the text, as anywhere.
                finish_reason, stop_reason = "stop", self.detokenizer.stop_string
            elif finish_reason == "stop" and last in self.params.stop_token_ids:
                stop_reason = last
        self.finished = finish_reason is not None
        self.collector.put(
            RequestOutput(
                request_id=self.request_id,
                text=text,
                token_ids=list(output.new_token_ids),
                cumulative_text=self.detokenizer.text,
                num_prompt_tokens=len(self.prompt_token_ids),
                num_output_tokens=self.num_output_tokens,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=output.new_logprobs,
                prompt_logprobs=output.prompt_logprobs,
                embedding=None if output.embedding is None else _floats(output.embedding),
                index=self.index,
                num_cached_tokens=self.num_cached_tokens,
                num_resumes=self.num_resumes,
            )
        )
        if finish_reason is not None:
            self.ended(finish_reason)
        return update.stop_string is not None

    def _time(self, num_tokens: int) -> None:
        now = time.monotonic()
        if num_tokens == 0:
            return
        if self._first_token_at is None:
            self._first_token_at = now
        else:
            gap = (now - self._last_output_at) / num_tokens
            self._inter_token_s.extend([gap] * num_tokens)
        self._last_output_at = now

    def forget(self) -> None:
        """The request was refused before it ran (a sibling sample could not
        be submitted): the observer is never told, as for any refused request."""
        self._on_end = None

    def ended(self, finish_reason: str) -> None:
        """Tell the observer (once) that the request ended with ``finish_reason``."""
        if self._on_end is None:
            return
        on_end, self._on_end = self._on_end, None
        first = self._first_token_at
        on_end(
            RequestMetrics(
                finish_reason=finish_reason,
                num_prompt_tokens=len(self.prompt_token_ids),
                num_output_tokens=self.num_output_tokens,
                time_to_first_token_s=None if first is None else first - self._started,
                inter_token_s=tuple(self._inter_token_s),
                e2e_s=time.monotonic() - self._started,
                engine_index=self.engine_index,
                queued_s=self.queued_s,
                max_tokens=self.params.max_tokens,
                num_resumes=self.num_resumes,
            )
        )


def _floats(data: bytes) -> list[float]:
    """A vector as the engine core sends it: float32, little-endian."""
    return list(struct.unpack(f"<{len(data) // 4}f", data))
