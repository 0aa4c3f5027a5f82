"""A request's sampling parameters (``SamplingParams``), each checked when
it is built, and the bounds on what a request may ask for.

``messages`` carries them (``AddRequest``) and re-exports them; the public
face is ``trioserve.SamplingParams``.
"""

from __future__ import annotations

import msgspec

from trioserve.checks import (
    MAX_INT32,
    bad,
    check_bool,
    check_float,
    check_int,
    check_logit_bias,
    check_strings,
    check_token_ids,
    check_token_sequences,
)
from trioserve.errors import InvalidRequestError
from trioserve.lora import check_lora_name
from trioserve.pooling import PoolingParams
from trioserve.structured import StructuredOutput, check_constraint

# Bounds on what a request may ask for: each keeps a value inside what the
# engine and msgpack can carry, and the per-request cost of stop strings small.
MAX_STOP_STRINGS = 64  # entries in ``stop``
MAX_STOP_CHARS = 4096  # characters in all of ``stop`` together
MAX_STOP_TOKEN_IDS = 64  # entries in ``stop_token_ids``
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 1024  # entries in ``logit_bias``
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ALLOWED_TOKEN_IDS = 2**18  # entries in ``allowed_token_ids``: more than any vocabulary served
MAX_BAD_WORDS = 64  # entries in ``bad_words``
MAX_BAD_WORDS_CHARS = 4096  # characters in all of ``bad_words`` together
MAX_BAD_WORD_TOKENS = 64  # tokens in one of ``bad_words_token_ids``


GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy: logits / it would overflow float32


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """How to pick tokens for one request. Invalid values raise
    ``InvalidRequestError`` (a ``ValueError``) naming the field, at
    construction: every field is checked for its type and range (an int,
    float or str of exactly that type: msgpack cannot encode a subclass),
    and the struct is frozen, so a ``SamplingParams`` that exists can always
    cross a process boundary.

    ``temperature == 0`` means greedy, and so does any temperature below
    ``GREEDY_BELOW`` (dividing logits by it would overflow). ``top_k == 0`` and ``top_p == 1`` turn
    those filters off. With ``seed`` set, the tokens depend only on the seed,
    the prompt and the model: not on what else shares the batch. ``stop``
    holds at most ``MAX_STOP_STRINGS`` strings of ``MAX_STOP_CHARS``
    characters in all; ``stop_token_ids`` at most ``MAX_STOP_TOKEN_IDS`` ids.
    ``structured``: the one constraint the output is held to (a JSON schema,
    any JSON object, a regex, a choice, a grammar: ``trioserve.structured``);
    the request ends with ``"stop"`` once the constraint is complete.

    Before any of those, each row's logits are processed (``gpu/logits_processing.py``),
    greedy rows alike: ``logit_bias`` (at most ``MAX_LOGIT_BIAS`` token ids,
    each biased by at most ``MAX_ABS_LOGIT_BIAS``) is added; only
    ``allowed_token_ids`` may be picked, when given; a token that would
    complete one of ``bad_words_token_ids`` after the output so far is not;
    and while fewer than ``min_tokens`` tokens are out, neither EOS (unless
    ``ignore_eos``) nor a stop token id is, and no stop string counts.
    ``bad_words`` are words (at most ``MAX_BAD_WORDS``, of
    ``MAX_BAD_WORDS_CHARS`` characters in all) that the engine's front-end
    tokenizes into ``bad_words_token_ids``, as they stand and after a space.
    Token ids are checked against the model's vocabulary by the engine
    (``Engine.stream``), which knows it.

    ``prompt_logprobs``: the logprob of each prompt token given those before
    it, and of its top alternatives, delivered with the first output; such a
    request computes its whole prompt (no prefix-cache hit). The text: a
    stop string is cut off unless ``include_stop_str_in_output`` (so is the
    text of a stop token id or EOS that ended the request); special tokens
    are left out of it unless ``skip_special_tokens`` is false.
    ``spaces_between_special_tokens`` is accepted for compatibility: the
    tokenizers served here (fast ones) never add such spaces.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    pooling: PoolingParams | None = None  # an embedding request (Engine.encode sets it; trioserve.pooling)
    lora: str | None = None  # the name of the LoRA adapter to run with (None: the base model; trioserve.lora)

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, MAX_INT32)
        check_int("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})", self.min_tokens)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_int("top_k", self.top_k, 0, MAX_INT32, note="0 turns it off")
        check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        check_strings("stop", self.stop, max_count=MAX_STOP_STRINGS, max_chars=MAX_STOP_CHARS, what="stop string")
        check_token_ids("stop_token_ids", self.stop_token_ids, max_count=MAX_STOP_TOKEN_IDS)
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        check_logit_bias("logit_bias", self.logit_bias, max_entries=MAX_LOGIT_BIAS, max_abs=MAX_ABS_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            check_token_ids(
                "allowed_token_ids", self.allowed_token_ids, max_count=MAX_ALLOWED_TOKEN_IDS, allow_empty=False
            )
        check_strings("bad_words", self.bad_words, max_count=MAX_BAD_WORDS, max_chars=MAX_BAD_WORDS_CHARS, what="word")
        check_token_sequences(
            "bad_words_token_ids", self.bad_words_token_ids, max_count=2 * MAX_BAD_WORDS, max_length=MAX_BAD_WORD_TOKENS
        )
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise bad("pooling", "must be a PoolingParams or None", self.pooling)
        if self.lora is not None:
            try:
                check_lora_name(self.lora)
            except ValueError as exc:
                raise InvalidRequestError("lora", str(exc)) from None
        if self.structured is not None and (problem := check_constraint(self.structured)) is not None:
            raise InvalidRequestError("structured", problem)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processes_logits(self) -> bool:
        """Whether its rows' logits are processed before sampling (``gpu/logits_processing.py``)."""
        return bool(
            self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids or self.min_tokens
        )
