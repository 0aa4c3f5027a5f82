"""Responses of the completions and chat endpoints, whole or as events.

``Choices`` gathers a parent request's samples as their deltas arrive;
``EventFormat`` turns them into OpenAI's JSON: the whole response, and the
stream's chunks (``text_completion`` / ``chat.completion.chunk``). Plain
functions and state, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import SampleLogprobs
from trioserve.server import openai_protocol as oai


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    placer: oai.TokenPlacer | None = None  # a stream's: which tokens' logprobs went out


class Choices:
    """The ``n`` samples of one request, as far as they have come."""

    def __init__(self, n: int) -> None:
        self.items = [Choice() for _ in range(n)]

    def add(self, out: RequestOutput) -> Choice:
        choice = self.items[out.index]
        choice.text += out.text
        choice.token_ids += out.token_ids
        if out.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + out.logprobs
        choice.finish_reason = out.finish_reason
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = out.num_cached_tokens or 0
        return choice

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.items)

    @property
    def cached_tokens(self) -> int:
        """The first sample's cached prompt tokens (the prompt is counted once)."""
        return self.items[0].num_cached_tokens


class EventFormat:
    """One endpoint's JSON: ``completion`` or ``chat``."""

    def __init__(self, kind: str, model: str, tokenizer: Tokenizer) -> None:
        self.kind = kind
        self.model = model
        self.tokenizer = tokenizer  # for logprobs: each token's text and bytes
        self.id = oai.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = oai.now()

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, choice: Choice, placer: oai.TokenPlacer) -> Any:
        """The logprobs of ``choice``'s tokens that ``placer`` has not taken
        yet and whose text has come (None when none were asked for)."""
        if choice.logprobs is None:
            return None
        placed = placer.place(choice.token_ids, choice.logprobs, len(choice.text))
        if self.kind == "chat":
            return oai.chat_logprobs(placed, self.tokenizer)
        return oai.completion_logprobs(placed, self.tokenizer)

    def response(self, choices: Choices, prompt_tokens: int) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        items = []
        for index, c in enumerate(choices.items):
            item: dict[str, Any] = {
                "index": index,
                "logprobs": self._logprobs(c, oai.TokenPlacer(self.tokenizer)),
                "finish_reason": _finish(c.finish_reason),
            }
            if self.kind == "chat":
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            items.append(item)
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion", items)
        body["usage"] = oai.usage(prompt_tokens, choices.completion_tokens, choices.cached_tokens)
        return body

    def opening(self, n: int, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks sent before any token: for chat, each choice's role."""
        if self.kind != "chat":
            return []
        return [
            self._chunk(index, {"role": "assistant", "content": ""}, None, None, include_usage) for index in range(n)
        ]

    def chunk(self, out: RequestOutput, choices: Choices, include_usage: bool) -> dict[str, Any]:
        """The chunk for one delta of one sample."""
        choice = choices.items[out.index]
        # The tokens whose text has come: those of earlier chunks whose text was held back, and this
        # chunk's as far as the text goes (the rest wait for a later chunk; at the sample's end, those
        # past its final text are left out).
        if choice.placer is None:
            choice.placer = oai.TokenPlacer(self.tokenizer)
        logprobs = self._logprobs(choice, choice.placer)
        delta: Any = {"content": out.text} if self.kind == "chat" else out.text
        return self._chunk(out.index, delta, logprobs, _finish(out.finish_reason), include_usage)

    def _chunk(self, index: int, delta: Any, logprobs: Any, finish: str | None, include_usage: bool) -> dict[str, Any]:
        item: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        item["delta" if self.kind == "chat" else "text"] = delta
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [item])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, choices: Choices, prompt_tokens: int) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        body["usage"] = oai.usage(prompt_tokens, choices.completion_tokens, choices.cached_tokens)
        return body


def _finish(reason: str | None) -> str | None:
    """OpenAI's finish reasons are ``stop`` and ``length`` (the server answers
    an engine's abort with an error instead: ``http_api._check_not_aborted``)."""
    return reason


def chat_format(model: str, tokenizer: Tokenizer) -> EventFormat:
    return EventFormat("chat", model, tokenizer)


def completion_format(model: str, tokenizer: Tokenizer) -> EventFormat:
    return EventFormat("completion", model, tokenizer)
