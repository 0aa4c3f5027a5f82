"""What a request may make the front-end hold, and what all of them may.

A request's outputs pass through the front-end (its tokens, its text, each
token's logprob alternatives) and a caller that waits for the whole answer
(``Engine.generate``, a non-streamed HTTP request) holds them all. Its
*entries*, the most it can hold, are counted before it is submitted:

    n x (output tokens x (1 + logprobs) + prompt tokens x (1 + prompt_logprobs))

where output tokens are at most ``min(max_tokens, max_model_len - prompt
tokens)`` and the prompt term counts only when prompt logprobs are asked
for. One request may have at most ``EngineConfig.max_request_entries``
(else ``InvalidRequestError`` naming ``max_tokens``, which a client lowers,
with ``n`` and ``logprobs``); the requests in flight in one front-end at
most ``max_held_entries`` together (else ``EngineOverloadedError``: retry
later). A request alone is always admitted when it is within its own bound.
Plain state, no I/O.
"""

from __future__ import annotations

from trioserve.errors import EngineOverloadedError, InvalidRequestError
from trioserve.sampling_params import SamplingParams


def request_entries(params: SamplingParams, n: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """The most entries one request can make the front-end hold."""
    outputs = max(0, min(params.max_tokens, max_model_len - num_prompt_tokens))
    entries = outputs * (1 + (params.logprobs or 0))
    if params.prompt_logprobs is not None:
        entries += num_prompt_tokens * (1 + params.prompt_logprobs)
    return n * entries


class HeldEntries:
    """The entries of the requests in flight in one front-end."""

    def __init__(self, max_request_entries: int, max_held_entries: int) -> None:
        self.max_request_entries = max_request_entries
        self.max_held_entries = max_held_entries
        self.held = 0

    def take(self, entries: int) -> None:
        """Count a request's ``entries`` (``give`` them back when it ends).
        Raises ``InvalidRequestError`` when it alone may make more than
        ``max_request_entries``, ``EngineOverloadedError`` when the requests
        in flight hold too many for it to join them now."""
        if entries > self.max_request_entries:
            raise InvalidRequestError(
                "max_tokens",
                f"n x (max_tokens x (1 + logprobs) + prompt tokens x (1 + prompt_logprobs)) may be at most "
                f"{self.max_request_entries} (got {entries}; max_tokens counts at most what the context leaves "
                "after the prompt): lower max_tokens, n or logprobs",
            )
        if self.held and self.held + entries > self.max_held_entries:
            raise EngineOverloadedError(
                f"the requests in flight may hold {self.held} output entries, and this one {entries} more, "
                f"beyond this front-end's {self.max_held_entries} (max_held_entries); retry later"
            )
        self.held += entries

    def give(self, entries: int) -> None:
        self.held -= entries
        assert self.held >= 0, self.held
