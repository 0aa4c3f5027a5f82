"""Nothing a client sends takes anything down: arbitrary input against a real
server (WebSocket frames) and against the embedding API (Python values).

The server test runs one in-process ``Server`` on the fake runner for all
its examples; hypothesis drives a client in a worker thread (the
``websockets`` sync client), with the server in the test's own Trio run.
Each frame is judged by a model of docs/websocket-protocol.md written
here (``expected_answer``): the set of errors that would be correct (any
one of them, when the frame breaks several rules), or "the request runs"
(then its tokens must be the fake runner's), or "no answer" (a cancel of an
id not in flight), or "closed with 1009" (over ``max_message_bytes``).
After every frame a valid request on the same connection must complete:
the connection carried on. Beside it, another connection streams valid
requests the whole time and checks their tokens. At the end: a new
connection is served, the front-end holds no request, every KV block is
free, the engine never restarted, and nothing was logged at ERROR (no
traceback). The context (``MAX_MODEL_LEN``) is long enough that prompts
over ``SYNC_TOKENIZE_CHARS`` are tokenized in a thread, a path of its own.

The embedding-API test does the same with one engine: arbitrary values for
each ``SamplingParams`` field and arbitrary prompts, each either accepted
(then the request completes with the fake runner's tokens) or refused with
a ``ValueError`` naming the field.

Examples are derandomized and nothing is written to a database, so a run
is the same every time.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import trio
from helpers.fakes import VOCAB, fake_tokens
from helpers.server import open_ws, serving
from helpers.waiting import in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

import trioserve
from trioserve import Engine, EngineConfig, RequestOutput, SamplingParams
from trioserve.checks import MAX_INT32
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from trioserve.server import Server

MAX_MODEL_LEN = 1024  # over SYNC_TOKENIZE_CHARS / 5 (the longest token): long texts are tokenized in a thread
MAX_MESSAGE_CHARS = 64 * 1024
DEEP = 700  # from this nesting depth on, the server may also answer invalid_json (its decoder's stack)

INVALID_JSON, UNKNOWN_TYPE = "invalid_json", "unknown_type"
INVALID_FIELD, PROMPT_TOO_LONG = "invalid_field", "prompt_too_long"
GENERATE_FIELDS = {"type", "id", "prompt", "prompt_token_ids", "params"}
CANCEL_FIELDS = {"type", "id"}
PARAM_FIELDS = tuple(SamplingParams.__struct_fields__)

SERVER_SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# --- JSON text, including what JSON libraries disagree on ---------------------------


@dataclass(frozen=True)
class Obj:
    """A JSON object written pair by pair: a key may repeat (the last one counts)."""

    pairs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Deep:
    """``n`` nested arrays (``[[...]]``) or objects (``{"d": {"d": ... null}}``)."""

    n: int
    kind: str

    def __repr__(self) -> str:
        return f"Deep({self.n}, {self.kind!r})"

    def text(self) -> str:
        if self.kind == "array":
            return "[" * self.n + "]" * self.n
        return '{"d":' * self.n + "null" + "}" * self.n

    def value(self) -> Any:
        inner: Any = [] if self.kind == "array" else None
        for _ in range(self.n - 1 if self.kind == "array" else self.n):
            inner = [inner] if self.kind == "array" else {"d": inner}
        return inner


@dataclass(frozen=True)
class Lit:
    """JSON text written as is: ``NaN``, ``1e400``, a 4,301-digit integer..."""

    text: str


def to_json(value: Any) -> str:
    """``value`` as JSON text. Strings with a lone surrogate become ``\\u`` escapes."""
    if isinstance(value, Obj):
        return "{" + ",".join(f"{to_json(k)}:{to_json(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return to_json(Obj(tuple(value.items())))
    if isinstance(value, list):
        return "[" + ",".join(map(to_json, value)) + "]"
    if isinstance(value, Deep):
        return value.text()
    if isinstance(value, Lit):
        return value.text
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=len(value) % 2 == 1 or not _utf8(value))
    return json.dumps(value)


class _NotJSON(Exception):
    """Text that a strict JSON decoder must refuse (or a number it cannot hold)."""


def effective(value: Any, depth: int = 1) -> tuple[Any, int]:
    """What a decoder makes of ``to_json(value)`` and how deeply it nests
    (``value`` at ``depth``). Raises ``_NotJSON`` for a lone surrogate,
    ``NaN``/``Infinity`` or a number out of range."""
    if isinstance(value, Obj | dict):
        out, deepest = {}, depth
        for k, v in value.pairs if isinstance(value, Obj) else value.items():
            if not _utf8(k):
                raise _NotJSON
            out[k], d = effective(v, depth + 1)
            deepest = max(deepest, d)
        return out, deepest
    if isinstance(value, list):  # written by a strategy: not deep
        items = [effective(v, depth + 1) for v in value]
        return [v for v, _ in items], max([depth, *(d for _, d in items)])
    if isinstance(value, Deep):
        return value.value(), depth - 1 + value.n
    if isinstance(value, Lit):
        value = _parse(value.text)
    return value, _check_decoded(value, depth)


def _check_decoded(value: Any, depth: int) -> int:
    """How deeply a decoded value nests; raises ``_NotJSON`` as ``effective``
    does. Without recursion: the value may nest deeply."""
    deepest, stack = depth, [(value, depth)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            if not all(map(_utf8, v)):
                raise _NotJSON
            stack += [(item, d + 1) for item in v.values()]
        elif isinstance(v, list):
            stack += [(item, d + 1) for item in v]
        elif (isinstance(v, float) and not math.isfinite(v)) or (isinstance(v, str) and not _utf8(v)):
            raise _NotJSON
    return deepest


def _parse(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise _NotJSON

    try:
        return json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError):
        raise _NotJSON from None


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --- what the protocol says the answer is --------------------------------------------


@dataclass(frozen=True)
class Run:
    """A valid request: what its output must be."""

    prompt_ids: list[int]
    max_tokens: int
    stop_reasons: list[str | int]


@dataclass(frozen=True)
class Answer:
    """What the server may answer to one frame: one error of ``errors``
    (``(code, field, id)``, any one of them), or the request ``runs``, or
    nothing at all (``silent``), or the connection closes with 1009."""

    errors: frozenset[tuple[str, str | None, str | None]] = frozenset()
    runs: Run | None = None
    silent: bool = False
    closes: bool = False
    request_id: str | None = None  # a generate's valid id: its terminal message is awaited


def not_json() -> Answer:
    return Answer(errors=frozenset({(INVALID_JSON, None, None)}))


def expected_answer(payload: str | bytes, value: Any, tokenizer: Tokenizer) -> Answer:
    """The answer to the frame ``payload``; ``value`` is the structure it was
    written from (None for raw text, which is then parsed here)."""
    if len(payload) > MAX_MESSAGE_CHARS:
        return Answer(closes=True)
    if isinstance(payload, bytes):
        return not_json()
    try:
        message, depth = effective(Lit(payload) if value is None else value)
    except _NotJSON:
        return not_json()
    answer = _answer_to(message, tokenizer)
    if depth >= DEEP:
        return Answer(answer.errors | not_json().errors, answer.runs, answer.silent, request_id=answer.request_id)
    return answer


def _answer_to(message: Any, tokenizer: Tokenizer) -> Answer:
    if not isinstance(message, dict):
        return not_json()
    raw_id = message.get("id") if _valid_id(message.get("id")) else None  # only a valid id is echoed
    kind = message.get("type")
    if kind == "generate":
        return _answer_to_generate(message, tokenizer)
    if kind == "cancel":
        errors = {(INVALID_FIELD, field, raw_id) for field in _unknown(message, CANCEL_FIELDS, "")}
        if not _valid_id(message.get("id")):
            errors.add((INVALID_FIELD, "id", None))
        return Answer(errors=frozenset(errors), silent=not errors)
    if "type" not in message:
        return Answer(errors=frozenset({(INVALID_FIELD, "type", raw_id)}))
    return Answer(errors=frozenset({(UNKNOWN_TYPE, None, raw_id)}))


def _answer_to_generate(message: dict[str, Any], tokenizer: Tokenizer) -> Answer:
    request_id = message.get("id")
    if not _valid_id(request_id):
        return Answer(errors=frozenset({(INVALID_FIELD, "id", None)}))
    errors = [(INVALID_FIELD, field) for field in _unknown(message, GENERATE_FIELDS, "")]
    prompt, token_ids = message.get("prompt"), message.get("prompt_token_ids")
    prompt_ids: list[int] | None = None
    if (prompt is None) == (token_ids is None) or (prompt is not None and not isinstance(prompt, str)):
        errors.append((INVALID_FIELD, "prompt"))
    elif token_ids is not None and not isinstance(token_ids, list):
        errors.append((INVALID_FIELD, "prompt_token_ids"))
    else:
        prompt_ids, prompt_errors = _check_prompt(prompt, token_ids, tokenizer)
        errors += prompt_errors
    params = message.get("params", {})
    if not isinstance(params, dict):
        errors.append((INVALID_FIELD, "params"))
    else:
        errors += [(INVALID_FIELD, field) for field in _unknown(params, set(PARAM_FIELDS), "params.")]
        bad_params = [name for name, v in params.items() if not param_ok(name, v, json_keys=True)]
        if not bad_params and set(params) <= set(PARAM_FIELDS):
            bad_params = engine_param_errors(params, tokenizer)
        errors += [(INVALID_FIELD, f"params.{name}") for name in bad_params]
    if errors:
        return Answer(errors=frozenset((code, field, request_id) for code, field in errors), request_id=request_id)
    assert prompt_ids is not None
    run = Run(prompt_ids, params.get("max_tokens", 16), [*params.get("stop", []), *params.get("stop_token_ids", [])])
    return Answer(runs=run, request_id=request_id)


def _check_prompt(
    prompt: str | None, token_ids: list[Any] | None, tokenizer: Tokenizer
) -> tuple[list[int] | None, list[tuple[str, str]]]:
    """The prompt's token ids, or the errors it deserves."""
    if prompt is not None:
        if len(prompt) > MAX_MODEL_LEN * tokenizer.max_token_chars:
            return None, [(PROMPT_TOO_LONG, "prompt")]
        token_ids = tokenizer.encode(prompt) if prompt else []
        if not token_ids:
            return None, [(INVALID_FIELD, "prompt")]
        return (token_ids, []) if len(token_ids) < MAX_MODEL_LEN else (None, [(PROMPT_TOO_LONG, "prompt")])
    assert token_ids is not None
    errors = []
    if not token_ids or not all(_is_int(t) and 0 <= t < VOCAB for t in token_ids):
        errors.append((INVALID_FIELD, "prompt_token_ids"))
    if len(token_ids) >= MAX_MODEL_LEN:
        errors.append((PROMPT_TOO_LONG, "prompt_token_ids"))
    return (None, errors) if errors else (token_ids, [])


def _unknown(message: dict[str, Any], known: set[str], prefix: str) -> list[str]:
    return [prefix + (k if len(k) <= 64 else k[:64] + "...") for k in set(message) - known]


def _valid_id(value: object) -> bool:
    return isinstance(value, str) and 1 <= len(value) <= 256


def _is_int(value: object) -> bool:
    return type(value) is int  # not a bool, nor a subclass (msgpack cannot send one to the engine core)


def _in(value: object, low: float, high: float, *, low_open: bool = False) -> bool:
    number = type(value) in (int, float)
    return number and (low < value <= high if low_open else low <= value <= high)  # type: ignore[operator]


def _token_id(value: object) -> bool:
    return _is_int(value) and 0 <= value <= MAX_INT32  # type: ignore[operator]


def _strings(value: object, max_count: int, max_chars: int) -> bool:
    """A list of at most ``max_count`` non-empty, encodable strings of ``max_chars`` characters in all."""
    return (
        isinstance(value, list)
        and len(value) <= max_count
        and all(type(s) is str and s and _utf8(s) for s in value)
        and sum(map(len, value)) <= max_chars
    )


def _min_above_max(params: dict[str, Any]) -> bool:
    """``min_tokens`` above ``max_tokens``: each may be valid alone, not together."""
    return bool(params.get("min_tokens", 0) > params.get("max_tokens", 16))


def _token_ids(value: object, max_count: int, min_count: int = 0) -> bool:
    return isinstance(value, list) and min_count <= len(value) <= max_count and all(map(_token_id, value))


def _json_token_id(key: object) -> bool:
    """A JSON object's key that msgspec reads as a token id (``logit_bias``'s keys)."""
    return isinstance(key, str) and re.fullmatch(r"-?(0|[1-9][0-9]*)", key) is not None and 0 <= int(key) <= MAX_INT32


def _logit_bias(value: object, json_keys: bool) -> bool:
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        return False
    key_ok = _json_token_id if json_keys else _token_id
    return all(key_ok(k) and _in(v, -100, 100) for k, v in value.items())


def engine_param_errors(params: dict[str, Any], tokenizer: Tokenizer) -> list[str]:
    """The fields of valid ``params`` that the engine still refuses: one
    against another (``min_tokens`` above ``max_tokens``), or a token id
    outside the vocabulary, or bad words too long or too many once tokenized."""
    errors = []
    if _min_above_max(params):
        errors.append("min_tokens")
    if any(int(t) >= VOCAB for t in params.get("logit_bias", {})):
        errors.append("logit_bias")
    if any(t >= VOCAB for t in params.get("allowed_token_ids") or []):
        errors.append("allowed_token_ids")
    given = params.get("bad_words_token_ids", [])
    if any(t >= VOCAB for word in given for t in word):
        errors.append("bad_words_token_ids")
    sequences = list(given)
    for word in params.get("bad_words", []):
        ids = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if len(ids) > MAX_BAD_WORD_TOKENS:
            errors.append("bad_words")
        elif ids and ids not in sequences:
            sequences.append(ids)
    if len(sequences) > 2 * MAX_BAD_WORDS:
        errors.append("bad_words")
    return errors


def param_ok(name: str, value: object, *, json_keys: bool = False) -> bool:
    """Whether ``value`` is valid for the ``SamplingParams`` field ``name``
    (its docstring and the limits in ``trioserve.messages``); ``json_keys``:
    a map's keys are as JSON writes them (strings)."""
    checks: dict[str, Callable[[Any], bool]] = {
        "max_tokens": lambda v: _is_int(v) and 1 <= v <= MAX_INT32,
        "temperature": lambda v: _in(v, 0, 100),
        "top_p": lambda v: _in(v, 0, 1, low_open=True),
        "top_k": lambda v: _is_int(v) and 0 <= v <= MAX_INT32,
        "min_p": lambda v: _in(v, 0, 1),
        "seed": lambda v: v is None or (_is_int(v) and 0 <= v < 2**63),
        "presence_penalty": lambda v: _in(v, -2, 2),
        "frequency_penalty": lambda v: _in(v, -2, 2),
        "repetition_penalty": lambda v: _in(v, 0, 10, low_open=True),
        "stop": lambda v: _strings(v, MAX_STOP_STRINGS, MAX_STOP_CHARS),
        "stop_token_ids": lambda v: (
            isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in v)
        ),
        "ignore_eos": lambda v: isinstance(v, bool),
        "logprobs": lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
        # Constraints change the tokens (tests/test_structured_*.py): here, only that nothing else is one.
        "structured": lambda v: v is None,
        # An embedding request's (tests/test_embeddings.py): here, only that a generation request has none.
        "pooling": lambda v: v is None,
        # An adapter's name (tests/test_lora*.py): here, on an engine without adapters, none.
        "lora": lambda v: v is None,
        "min_tokens": lambda v: _is_int(v) and 0 <= v <= MAX_INT32,
        "include_stop_str_in_output": lambda v: isinstance(v, bool),
        "prompt_logprobs": lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
        "logit_bias": lambda v: _logit_bias(v, json_keys),
        "allowed_token_ids": lambda v: v is None or _token_ids(v, MAX_ALLOWED_TOKEN_IDS, 1),
        "bad_words": lambda v: _strings(v, MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS),
        "bad_words_token_ids": lambda v: (
            isinstance(v, list)
            and len(v) <= 2 * MAX_BAD_WORDS
            and all(_token_ids(word, MAX_BAD_WORD_TOKENS, 1) for word in v)
        ),
        "skip_special_tokens": lambda v: isinstance(v, bool),
        "spaces_between_special_tokens": lambda v: isinstance(v, bool),
    }
    return name not in checks or bool(checks[name](value))


# --- strategies -----------------------------------------------------------------------

BIG_INTS = [2**31, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30), 10**4299]
ODD_FLOATS = [1e308, -1e308, 1.7976931348623157e308, -0.0, 5e-324, 0.1, 1e-7]
ODD_LITERALS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E2", "-0", "1.0", "0e0", "1" + "0" * 4300]


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn about ``weight`` times as often."""
    return st.one_of(*(strategy for weight, strategy in choices for _ in range(weight)))


ints = weighted((2, st.integers()), (2, st.integers(-3, 300)), (1, st.sampled_from(BIG_INTS)))
floats = weighted((2, st.floats(allow_nan=False, allow_infinity=False)), (1, st.sampled_from(ODD_FLOATS)))
long_texts = st.builds(str.__mul__, st.sampled_from(["x", "é", "\U0001f600", "ab "]), st.integers(200, 40_000))
surrogate_texts = st.text(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=6)
texts = weighted((6, st.text(max_size=12)), (1, long_texts), (1, surrogate_texts))
deep = st.builds(
    Deep,
    st.integers(1, 40) | st.integers(880, 1010) | st.integers(1010, 30_000),
    st.sampled_from(["array", "object"]),
)
scalars = weighted(
    (1, st.none()),
    (1, st.booleans()),
    (3, ints),
    (2, floats),
    (3, texts),
    (1, st.builds(Lit, st.sampled_from(ODD_LITERALS))),
)


def _objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text(max_size=8) | st.sampled_from(["type", "id", "d"])
    return st.builds(lambda pairs: Obj(tuple(pairs)), st.lists(st.tuples(keys, children), max_size=4))


json_values = weighted(
    (1, deep), (6, st.recursive(scalars, lambda c: st.lists(c, max_size=4) | _objects(c), max_leaves=8))
)

VALID_PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": weighted((9, st.integers(1, 60)), (1, st.just(MAX_INT32))),  # MAX_INT32: until the context is full
    "temperature": st.floats(0, 100) | st.just(-0.0),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(0, MAX_INT32),
    "min_p": st.floats(0, 1),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 10, exclude_min=True),
    "stop": st.lists(st.text(min_size=1, max_size=4) | st.characters(max_codepoint=127), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, MAX_INT32) | st.integers(0, VOCAB), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "structured": st.none(),
    "pooling": st.none(),
    "lora": st.none(),
    "min_tokens": st.integers(0, 20),
    "include_stop_str_in_output": st.booleans(),
    "prompt_logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 3).map(str), st.floats(-100, 100), max_size=4),  # JSON's keys
    "allowed_token_ids": st.none() | st.lists(st.integers(0, VOCAB + 3), min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=3),
    "bad_words_token_ids": st.lists(st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=3), max_size=3),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
}


# Too long as tokenized at once (from about 1,000 characters), in a thread (over 4,096) or
# without tokenizing (over 5,120): a character of "é" is two tokens.
long_prompts = st.builds(
    str.__mul__, st.sampled_from("aé"), st.integers(400, 1100) | st.integers(4090, 5130) | st.integers(5120, 6000)
)


@st.composite
def generate_messages(draw: st.DrawFn) -> Obj:
    """A ``generate`` that is valid, then has up to three of its fields
    (``id``, the prompt, each of ``params``, unknown ones) set to any JSON,
    and sometimes a key written twice."""
    params = draw(st.fixed_dictionaries({}, optional=VALID_PARAMS))
    prompt = draw(
        st.tuples(st.just("prompt"), st.text(min_size=1, max_size=30) | long_prompts)
        | st.tuples(st.just("prompt_token_ids"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        | st.tuples(st.just("prompt_token_ids"), st.builds(list.__mul__, st.just([1]), st.integers(1000, 1030)))
    )
    fields: dict[str, Any] = {"type": "generate", "id": draw(st.text(min_size=1, max_size=8)), prompt[0]: prompt[1]}
    if len(params) > 0 or draw(st.booleans()):
        fields["params"] = params
    targets = [*GENERATE_FIELDS, "unknown", "params.unknown", *(f"params.{name}" for name in PARAM_FIELDS)]
    for target in draw(st.lists(st.sampled_from(targets), max_size=3)):
        where, _, name = target.rpartition(".")
        into = fields.setdefault("params", {}) if where and isinstance(fields.get("params"), dict) else fields
        into[draw(st.text(min_size=1, max_size=70)) if name == "unknown" else name] = draw(json_values)
    return _with_repeats(draw, fields)


def _with_repeats(draw: st.DrawFn, fields: dict[str, Any]) -> Obj:
    """The fields as pairs; sometimes one key is written twice (with the same or another value)."""
    pairs = [(k, Obj(tuple(v.items())) if isinstance(v, dict) else v) for k, v in fields.items()]
    if pairs and draw(st.integers(0, 3)) == 0:
        key, value = pairs[draw(st.integers(0, len(pairs) - 1))]
        pairs.insert(draw(st.integers(0, len(pairs))), (key, draw(st.just(value) | json_values)))
    return Obj(tuple(pairs))


cancel_messages = st.builds(
    lambda request_id, extra: Obj((("type", "cancel"), ("id", request_id), *extra)),
    st.text(max_size=8) | json_values,
    st.lists(st.tuples(st.text(max_size=6), json_values), max_size=1),
)
other_messages = json_values | _objects(json_values)


@st.composite
def raw_frames(draw: st.DrawFn) -> str | bytes:
    """Frames that are not written from a structure: binary, empty, not
    JSON, truncated JSON, JSON padded with whitespace or a BOM."""
    message = to_json(draw(generate_messages()))
    return draw(
        st.binary(max_size=40)
        | st.sampled_from(["", " ", "null", "[]", "{}", '"generate"', "{'type': 'cancel'}", "[" * 5000])
        | st.text(max_size=40)
        | st.integers(0, len(message)).map(lambda n: message[:n])
        | st.sampled_from([" \n\t", "\ufeff", "\x00", "\u2028"]).map(lambda pad: pad + message + pad.strip("\ufeff"))
        | st.builds(frame_of_length, st.integers(MAX_MESSAGE_CHARS - 1, MAX_MESSAGE_CHARS + 1), st.sampled_from("xé😀"))
    )


def frame_of_length(length: int, char: str) -> str:
    """A ``cancel`` of ``length`` characters (the limit counts characters, not bytes)."""
    head = '{"type":"cancel","id":"a","pad":"'
    return head + char * (length - len(head) - 2) + '"}'


class Frame:
    """One client frame: ``payload``, written from the structure ``value``
    (None for a raw frame); ``cancel``: cancel the request at once, should it run."""

    def __init__(self, payload: str | bytes, value: Any, cancel: bool) -> None:
        self.payload = payload
        self.value = value
        self.cancel = cancel

    def __repr__(self) -> str:  # what hypothesis shows of a failing example: the frame as sent
        cut = "..." if len(self.payload) > 300 else ""
        return f"Frame({self.payload[:300]!r}{cut}, cancel={self.cancel})"


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    """Mostly ``generate``s, some ``cancel``s, any JSON, raw frames."""
    kind = draw(st.sampled_from(["generate"] * 6 + ["cancel", "json", "raw", "raw"]))
    cancel = draw(st.booleans())
    if kind == "raw":
        return Frame(draw(raw_frames()), None, cancel)
    strategy = {"generate": generate_messages(), "cancel": cancel_messages, "json": other_messages}[kind]
    value = draw(strategy)
    return Frame(to_json(value), value, cancel)


# --- the client ---------------------------------------------------------------------

PROBE_PROMPT = [11, 12, 13]
BESIDE_PROMPT = [7, 8, 9]


def generate_json(request_id: str, prompt_ids: list[int], max_tokens: int) -> str:
    params = {"max_tokens": max_tokens}
    return json.dumps({"type": "generate", "id": request_id, "prompt_token_ids": prompt_ids, "params": params})


# The fuzzing client's WebSocket options: any size of message read back, no keep-alive pings.
CLIENT_OPTIONS: dict[str, Any] = {"max_size": None, "ping_interval": None}


def receive(ws: ClientConnection) -> dict[str, Any]:
    """The next message; a silent server fails the test after 10 s."""
    message: dict[str, Any] = json.loads(ws.recv(timeout=10))
    assert message.get("type") in ("delta", "done", "error"), message
    return message


def check_completes(messages: list[dict[str, Any]], prompt_ids: list[int], max_tokens: int) -> None:
    """A valid request's messages: deltas with the fake runner's tokens, then ``done`` for ``length``."""
    *deltas, done = messages
    assert all(m["type"] == "delta" for m in deltas) and done["type"] == "done", messages
    tokens = [t for m in deltas for t in m["token_ids"]]
    assert tokens == fake_tokens(prompt_ids, max_tokens), messages
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == max_tokens, done


class FuzzClient:
    """The fuzzing client's connection (opened again after a documented close).

    ``send`` sends one frame, then a valid request (the probe), and checks
    the answer to the frame and that the probe completes: nothing of the
    frame's is left in flight when it returns."""

    def __init__(self, url: str, tokenizer: Tokenizer) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.ws: ClientConnection | None = None
        self._opened = ExitStack()

    def close(self) -> None:
        self._opened.close()
        self.ws = None

    def send(self, frame: Frame) -> None:
        answer = expected_answer(frame.payload, frame.value, self.tokenizer)
        if self.ws is None:
            self.ws = self._opened.enter_context(open_ws(self.url, **CLIENT_OPTIONS))
        self.ws.send(frame.payload)
        if answer.closes:
            with pytest.raises(ConnectionClosed) as closed:
                receive(self.ws)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
            self.ws = None
            return
        if answer.runs is not None and frame.cancel:
            self.ws.send(json.dumps({"type": "cancel", "id": answer.request_id}))
        probe_id = f"probe:{uuid.uuid4().hex}"
        self.ws.send(generate_json(probe_id, PROBE_PROMPT, 2))
        probe, answered = self._read(probe_id, answer.request_id)
        check_answer(answer, frame.cancel, answered)
        check_completes(probe, PROBE_PROMPT, 2)

    def _read(self, probe_id: str, request_id: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The probe's messages and the others, read until the probe has
        ended and, if the frame was a generate with a valid id, until that
        request has ended or the frame was refused without naming it."""
        assert self.ws is not None
        probe: list[dict[str, Any]] = []
        answered: list[dict[str, Any]] = []

        def frame_done() -> bool:
            if request_id is None:
                return True
            return any(m["id"] in (request_id, None) and m["type"] != "delta" for m in answered)

        while not (probe and probe[-1]["type"] != "delta" and frame_done()):
            message = receive(self.ws)
            (probe if message["id"] == probe_id else answered).append(message)
        return probe, answered


def check_answer(answer: Answer, cancelled: bool, messages: list[dict[str, Any]]) -> None:
    """``messages`` (every message about the frame) are an answer ``answer`` allows."""
    if answer.silent and not messages:
        return
    if len(messages) == 1 and messages[0]["type"] == "error":
        error = messages[0]
        field = error.get("field")
        assert any(_matches(error, allowed) for allowed in answer.errors), (error, answer)
        assert field is None or error["message"].startswith(f"{field}:"), error
        return
    assert answer.runs is not None, (messages, answer)
    assert all(m["id"] == answer.request_id for m in messages), messages
    check_run(answer.runs, cancelled, messages)


def _matches(error: dict[str, Any], allowed: tuple[str, str | None, str | None]) -> bool:
    """``error`` is the allowed one; an item of a list, or a member of an object, may be named
    (``params.stop[2]``, ``params.structured.type``)."""
    code, field, request_id = allowed
    named = error.get("field")
    same_field = named == field or (
        field is not None and named is not None and named.startswith((f"{field}[", f"{field}."))
    )
    return error["code"] == code and error["id"] == request_id and same_field


def check_run(run: Run, cancelled: bool, messages: list[dict[str, Any]]) -> None:
    *deltas, done = messages
    assert all(m["type"] == "delta" for m in deltas) and done["type"] == "done", messages
    tokens = [t for m in deltas for t in m["token_ids"]]
    assert tokens == fake_tokens(run.prompt_ids, len(tokens)), messages
    cancelled_at_once = done["finish_reason"] == "abort" and done["usage"]["prompt_tokens"] == 0  # before it started
    assert cancelled_at_once or done["usage"]["prompt_tokens"] == len(run.prompt_ids), done
    assert len(tokens) <= done["usage"]["completion_tokens"] <= run.max_tokens, done
    if done["finish_reason"] == "length":
        expected = min(run.max_tokens, MAX_MODEL_LEN - len(run.prompt_ids))
        assert len(tokens) == done["usage"]["completion_tokens"] == expected, done
    elif done["finish_reason"] == "stop":
        assert done["stop_reason"] in run.stop_reasons, done
    else:
        assert done["finish_reason"] == "abort" and cancelled, done


def stream_beside(url: str, stop: threading.Event) -> int:
    """Well-formed requests, one after another on their own connection,
    until ``stop``; each must stream the fake runner's tokens. How many ran."""
    with open_ws(url, **CLIENT_OPTIONS) as ws:
        for i in range(100_000):
            if stop.is_set():
                return i
            ws.send(generate_json(f"beside-{i}", BESIDE_PROMPT, 30))
            messages = [receive(ws)]
            while messages[-1]["type"] == "delta":
                messages.append(receive(ws))
            assert all(m["id"] == f"beside-{i}" for m in messages), messages
            check_completes(messages, BESIDE_PROMPT, 30)
    raise AssertionError("the fuzzing outlasted the requests beside it")


def fuzz_server(url: str, tokenizer: Tokenizer) -> None:
    client = FuzzClient(url, tokenizer)

    @SERVER_SETTINGS
    @given(st.lists(frames(), min_size=1, max_size=3))
    def check(batch: list[Frame]) -> None:
        try:
            for frame in batch:
                client.send(frame)
        except BaseException:
            client.close()  # the next example starts afresh
            raise

    try:
        check()
    finally:
        client.close()


def probe_new_connection(url: str) -> None:
    with open_ws(url, **CLIENT_OPTIONS) as ws:
        ws.send(generate_json("after", PROBE_PROMPT, 5))
        messages = [receive(ws)]
        while messages[-1]["type"] == "delta":
            messages.append(receive(ws))
        check_completes(messages, PROBE_PROMPT, 5)


# --- the server test --------------------------------------------------------------


@contextmanager
def logged_errors() -> Iterator[list[logging.LogRecord]]:
    """Records trioserve logs at ERROR or with a traceback while the block runs."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR or record.exc_info:
                records.append(record)

    handler = Keep(logging.DEBUG)
    logger = logging.getLogger("trioserve")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


async def wait_engine_idle(server: Server) -> None:
    """Wait until the front-end holds no request and every KV block is free."""
    engine = server.engine
    assert engine is not None
    with trio.fail_after(5):
        while True:
            stats = await engine.stats()
            idle = stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            if idle and engine.num_requests_in_flight() == 0:
                return
            await trio.sleep(0.02)


async def test_no_frame_takes_down_the_server_or_a_connection_the_protocol_keeps(
    fake_config: Callable[..., EngineConfig],
) -> None:
    config = fake_config(max_model_len=MAX_MODEL_LEN, num_kv_blocks=2048, step_delay_s=0.0005)
    with trio.fail_after(200), logged_errors() as errors:
        async with serving(config, max_message_bytes=MAX_MESSAGE_CHARS) as server:
            assert server.engine is not None
            stop = threading.Event()
            beside: list[int] = []

            async def run_beside() -> None:
                beside.append(await in_thread(stream_beside, server.url, stop))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_beside)
                try:
                    await in_thread(fuzz_server, server.url, server.engine.tokenizer)
                finally:
                    stop.set()
            assert beside[0] > 0
            await in_thread(probe_new_connection, server.url)
            await wait_engine_idle(server)
            assert server.engine.num_restarts == 0
    assert not errors, [r.getMessage() for r in errors]


# --- the embedding API -----------------------------------------------------------------

API_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
API_PROMPT = [21, 22, 23]
# The sampling-parameters test's context: short, so that a max_tokens of MAX_INT32 (or a
# min_tokens past the context) fills it in a few dozen steps, not a thousand.
PARAMS_MODEL_LEN = 64


@dataclass(frozen=True)
class Built:
    """A value too big to print (hypothesis prints this instead): ``make(arg)``."""

    make: Callable[[int], Any]
    arg: int

    def __repr__(self) -> str:
        return f"{self.make.__name__}({self.arg})"


def nested_lists(n: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(n - 1):
        value = [value]
    return value


def ten_to_the(n: int) -> int:
    return int(10**n)


def minus_ten_to_the(n: int) -> int:
    return -int(10**n)


def materialize(value: Any) -> Any:
    """``value`` with every ``Built`` made."""
    if isinstance(value, Built):
        return value.make(value.arg)
    if isinstance(value, list | tuple):
        return type(value)(map(materialize, value))
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


class IntSubclass(int):
    pass


class FloatSubclass(float):
    pass


class StrSubclass(str):
    pass


class ListSubclass(list):  # type: ignore[type-arg]
    pass


ODD_OBJECTS = [
    Opaque(),
    IntSubclass(5),
    FloatSubclass(0.5),
    StrSubclass("x"),
    ListSubclass(["a"]),
    ListSubclass([3]),
    Decimal("1"),
    Fraction(1, 2),
    1j,
    range(3),
    (1, 2),
    frozenset(),
    bytearray(b"x"),
    b"",
    object,
    print,
]
python_ints = weighted(
    (3, st.integers()),
    (1, st.sampled_from(BIG_INTS)),
    (1, st.builds(Built, st.sampled_from([ten_to_the, minus_ten_to_the]), st.integers(4000, 20_000))),
)
python_scalars = weighted(
    (1, st.none()),
    (1, st.booleans()),
    (3, python_ints),
    (2, st.floats()),
    (2, texts),
    (1, st.binary(max_size=8)),
    (1, st.sampled_from(ODD_OBJECTS)),
    (1, st.builds(Built, st.just(nested_lists), st.integers(1, 40) | st.integers(900, 20_000))),
)
python_values = st.recursive(
    python_scalars,
    lambda c: st.lists(c, max_size=4) | st.tuples(c, c) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)


def check_generated(
    output: RequestOutput, prompt_ids: list[int], params: SamplingParams, max_model_len: int = MAX_MODEL_LEN
) -> None:
    """A finished request's whole output: the fake runner's tokens, and a reason that fits
    (``length``: ``max_tokens``, or the context of ``max_model_len`` full)."""
    tokens = output.token_ids
    assert tokens == fake_tokens(prompt_ids, len(tokens)), output
    assert output.num_prompt_tokens == len(prompt_ids), output
    if output.finish_reason == "length":
        assert len(tokens) == min(params.max_tokens, max_model_len - len(prompt_ids)), output
    else:
        assert output.finish_reason == "stop", output
        assert output.stop_reason in [*params.stop, *params.stop_token_ids], output


async def test_sampling_params_take_any_value_or_refuse_it_naming_the_field(
    fake_config: Callable[..., EngineConfig],
) -> None:
    with trio.fail_after(120), logged_errors() as errors:
        async with trioserve.open_engine(config=fake_config(max_model_len=PARAMS_MODEL_LEN)) as engine:
            await in_thread(fuzz_sampling_params, engine)
            await check_engine_served_throughout(engine)
    assert not errors, [r.getMessage() for r in errors]


def fuzz_sampling_params(engine: Engine) -> None:
    valid = {**VALID_PARAMS, "logit_bias": st.dictionaries(st.integers(0, VOCAB + 3), st.floats(-100, 100), max_size=4)}
    field_values = {name: weighted((1, valid[name]), (2, python_values)) for name in PARAM_FIELDS}

    @API_SETTINGS
    @given(st.fixed_dictionaries({}, optional=field_values))
    def check(fields: dict[str, Any]) -> None:
        fields = materialize(fields)
        invalid = [name for name, value in fields.items() if not param_ok(name, value)]
        if not {"max_tokens", "min_tokens"} & set(invalid) and _min_above_max(fields):
            invalid.append("min_tokens")
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            invalid = invalid or engine_param_errors(fields, engine.tokenizer)
            assert str(exc).partition(":")[0] in invalid, (exc, invalid)
            return
        assert not invalid, (params, invalid)
        refused = engine_param_errors(fields, engine.tokenizer)
        try:
            output = trio.from_thread.run(engine.generate, API_PROMPT, params)
        except ValueError as exc:
            assert str(exc).partition(":")[0] in refused, (exc, refused)
            return
        assert not refused, (params, refused)
        check_generated(output, API_PROMPT, params, engine.info.max_model_len)

    check()


async def test_any_prompt_runs_or_is_refused_naming_the_prompt(fake_config: Callable[..., EngineConfig]) -> None:
    with trio.fail_after(120), logged_errors() as errors:
        async with trioserve.open_engine(config=fake_config(max_model_len=MAX_MODEL_LEN)) as engine:
            await in_thread(fuzz_prompts, engine)
            await check_engine_served_throughout(engine)
    assert not errors, [r.getMessage() for r in errors]


prompts = weighted(
    (2, texts),
    (1, st.sampled_from(["", " ", "\x00", "\ufeff", "\U0001f600" * 20])),
    (1, long_prompts),
    (2, st.lists(st.integers(0, VOCAB - 1), max_size=30)),
    (1, st.builds(list.__mul__, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2), st.integers(500, 520))),
    (1, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5).map(tuple)),
    (2, st.lists(python_values, max_size=4)),
    (1, st.builds(Built, st.just(nested_lists), st.integers(1, 3) | st.integers(900, 20_000))),
    (1, st.builds(lambda n: Built(list_of_ones, n), st.integers(0, 200_000))),
    (1, st.builds(range, st.integers(0, 5)) | st.builds(range, st.sampled_from(BIG_INTS))),
    (2, python_values),
)


def _length(values: Sequence[Any]) -> int:
    try:
        return len(values)
    except OverflowError:  # range(2**64): longer than any list
        return 2**64


def list_of_ones(n: int) -> list[int]:
    return [1] * n


def expected_prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int] | None:
    """The prompt's token ids if it is a valid prompt for the engine, else None."""
    if isinstance(prompt, str):
        if not prompt or not _utf8(prompt) or len(prompt) > MAX_MODEL_LEN * tokenizer.max_token_chars:
            return None
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        if not 0 < _length(prompt) < MAX_MODEL_LEN:
            return None
        token_ids = list(prompt)
        if not all(_is_int(t) and 0 <= t < VOCAB for t in token_ids):
            return None
    else:
        return None
    return token_ids if 0 < len(token_ids) < MAX_MODEL_LEN else None


async def run_prompt(engine: Engine, prompt: Any, streamed: bool) -> RequestOutput:
    """``prompt`` through ``engine.stream`` or ``engine.generate``: the whole output."""
    params = SamplingParams(max_tokens=4)
    if not streamed:
        return await engine.generate(prompt, params)
    outputs = []
    async with engine.stream(prompt, params) as stream:
        outputs = [out async for out in stream]
    for out in outputs[1:]:
        outputs[0].merge(out)
    return outputs[0]


def fuzz_prompts(engine: Engine) -> None:
    @API_SETTINGS
    @given(prompts, st.booleans())
    def check(prompt: Any, streamed: bool) -> None:
        prompt = materialize(prompt)
        expected = expected_prompt_ids(prompt, engine.tokenizer)
        try:
            output = trio.from_thread.run(run_prompt, engine, prompt, streamed)
        except ValueError as exc:
            assert expected is None and str(exc).startswith("prompt:"), exc
            return
        assert expected is not None, output
        check_generated(output, expected, SamplingParams(max_tokens=4))

    check()


async def check_engine_served_throughout(engine: Engine) -> None:
    """The engine never restarted, still serves, and holds nothing."""
    assert engine.num_restarts == 0 and engine.health == "ready"
    output = await engine.generate(API_PROMPT, SamplingParams(max_tokens=3))
    check_generated(output, API_PROMPT, SamplingParams(max_tokens=3), engine.info.max_model_len)
    with trio.fail_after(5):
        while True:
            stats = await engine.stats()
            idle = stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            if idle and engine.num_requests_in_flight() == 0:
                return
            await trio.sleep(0.02)
