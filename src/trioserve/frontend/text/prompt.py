"""Every check of a prompt, in one place: a prompt is text or token ids,
and it must fit the engine's context with room for one output token.

The cost of checking is bounded by the context, not by the prompt: a text
longer than ``max_model_len`` times the longest token (in characters) cannot
fit, and is rejected without being tokenized. Shorter texts are tokenized;
long ones (over ``SYNC_TOKENIZE_CHARS``) off the Trio thread, at most
``TOKENIZE_THREADS`` at once per engine.

Text rendered from a chat template (``TemplatedText``) is tokenized without
adding special tokens: it holds them already. In its messages' contents,
the text of a special token is tokenized as text (``literal.MarkedText``).

Errors are ``InvalidRequestError`` (a ``ValueError``) naming the field
``prompt``, or ``PromptTooLongError`` when it does not fit.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import trio

from trioserve.checks import is_plain_int, is_valid_text, short_repr
from trioserve.errors import InvalidRequestError, PromptTooLongError
from trioserve.frontend.text.chat_template import TemplatedText
from trioserve.frontend.text.literal import MarkedText, encode_marked
from trioserve.frontend.text.tokenizer import GIL_FREE_ENCODE_CHARS, Tokenizer
from trioserve.messages import EngineInfo

log = logging.getLogger("trioserve.prompt")

Prompt = str | Sequence[int]

# Longer texts are tokenized in a worker thread, where the tokenizer releases the GIL for them.
SYNC_TOKENIZE_CHARS = GIL_FREE_ENCODE_CHARS
TOKENIZE_THREADS = 2  # tokenizing threads per engine at once


class PromptChecker:
    """Checks prompts against one engine's tokenizer and context, which
    must also hold ``output_room`` tokens after the prompt (one to generate;
    none for an embedding engine's prompts, whose whole work they are)."""

    def __init__(self, tokenizer: Tokenizer, info: EngineInfo, *, output_room: int = 1) -> None:
        self.tokenizer = tokenizer
        self.output_room = output_room
        # (What the KV cache holds bounds a prompt too: max_model_len is capped one above it, for generation.)
        self.max_prompt_len = min(info.max_model_len - output_room, info.num_kv_blocks * info.block_size)
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        # No prompt of more characters can fit the context: each token stands
        # for at most max_token_chars characters of text.
        self.max_chars = info.max_model_len * max(1, tokenizer.max_token_chars)
        self._threads = trio.CapacityLimiter(TOKENIZE_THREADS)
        # A tokenizer with more entries than the model's embedding (a packaging mistake) can
        # encode text to ids the model cannot take: those are checked for here.
        self._ids_may_overflow = tokenizer.vocab_size > info.vocab_size
        if self._ids_may_overflow:
            log.warning(
                "the tokenizer has %d entries but the model's vocabulary has %d: a text that encodes to a larger id "
                "is refused",
                tokenizer.vocab_size,
                info.vocab_size,
            )

    def needs_thread(self, prompt: Prompt) -> bool:
        """True for a text long enough to be tokenized off the Trio thread."""
        return isinstance(prompt, str) and len(prompt) > SYNC_TOKENIZE_CHARS

    def check(self, prompt: object) -> list[int]:
        """The prompt's token ids, checked. Raises ``InvalidRequestError``
        or ``PromptTooLongError`` naming ``prompt``."""
        if isinstance(prompt, str):
            return self._fit(self._encode(prompt))
        return self._fit(self._token_ids(prompt))

    async def check_async(self, prompt: object) -> list[int]:
        """``check``, tokenizing a long text in a worker thread. If
        cancelled, the thread's result is dropped when it ends."""
        if isinstance(prompt, str) and self.needs_thread(prompt):
            self._check_text(prompt)
            # The limiter is held until the thread ends, even when this is cancelled and
            # abandons it: never more than TOKENIZE_THREADS encodes at once per engine.
            token_ids = await trio.to_thread.run_sync(
                self._encode, prompt, abandon_on_cancel=True, limiter=self._threads
            )
            return self._fit(token_ids)
        return self.check(prompt)

    def _check_text(self, text: str) -> None:
        if text == "":
            raise InvalidRequestError("prompt", "must not be empty")
        if len(text) > self.max_chars:
            raise PromptTooLongError(
                "prompt",
                f"{len(text)} characters cannot fit the context of {self.max_model_len} tokens "
                f"(no token of this model is longer than {self.tokenizer.max_token_chars} characters)",
            )
        if not is_valid_text(text):
            raise InvalidRequestError("prompt", "invalid string: it holds a lone UTF-16 surrogate")

    def _encode(self, text: str) -> list[int]:
        self._check_text(text)
        if isinstance(text, MarkedText):
            token_ids = encode_marked(self.tokenizer, text)
        elif isinstance(text, TemplatedText):  # a chat template's text holds its special tokens already
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            token_ids = self.tokenizer.encode(text)
        if self._ids_may_overflow and token_ids and (largest := max(token_ids)) >= self.vocab_size:
            raise InvalidRequestError(
                "prompt",
                f"the text encodes to token id {largest}, outside this model's vocabulary of {self.vocab_size} "
                f"(its tokenizer has {self.tokenizer.vocab_size} entries)",
            )
        return token_ids

    def _token_ids(self, prompt: object) -> list[int]:
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError(
                "prompt", f"must be a string or a list of token ids (got {type(prompt).__name__})"
            )
        try:
            num_tokens = len(prompt)
        except OverflowError:  # range(2**64): more than any context
            raise PromptTooLongError("prompt", self._too_long(f"more than {sys.maxsize}")) from None
        if num_tokens > self.max_model_len:
            raise PromptTooLongError("prompt", self._too_long(num_tokens))
        token_ids = list(prompt)
        for t in token_ids:
            if not is_plain_int(t) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    "prompt", f"token ids must be integers in [0, {self.vocab_size}) (got {short_repr(t, 40)})"
                )
        return token_ids

    def _fit(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty (it encodes to no tokens)")
        if len(token_ids) > self.max_prompt_len:
            raise PromptTooLongError("prompt", self._too_long(len(token_ids)))
        return token_ids

    def _too_long(self, num_tokens: int | str) -> str:
        room = ", which must also hold at least one output token" if self.output_room else ""
        return f"{num_tokens} tokens do not fit the context of {self.max_model_len} tokens (max_model_len){room}"
