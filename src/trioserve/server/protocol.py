"""The WebSocket protocol as plain functions: client JSON in, typed messages
out; server messages built and encoded. No I/O, no trio.

Client messages: ``generate``, ``embed`` and ``cancel``. Server messages:
``delta``, ``done``, ``embedding``, ``error`` (docs/websocket-protocol.md).
Invariants: every parse failure becomes one ``ProtocolError`` whose
``message`` starts with the name of the offending field (when there is
one); every request ends with exactly one terminal message (``done`` or
``error``; an ``embed`` request, ``embedding`` or ``error``), the server's
side of which is kept by ``server/connection.py``.

This layer checks the shape of the JSON only: which fields exist and their
JSON types. What the values mean (a prompt that fits the context, token ids
in the vocabulary, sampling parameters in range) is checked once, by the
engine (``Engine.stream`` and ``SamplingParams``); the server maps the
engine's ``InvalidRequestError`` to this protocol's error.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeGuard

import msgspec
from msgspec import UNSET, UnsetType

from trioserve.checks import short_repr
from trioserve.errors import InvalidRequestError
from trioserve.messages import SampleLogprobs
from trioserve.sampling_params import SamplingParams
from trioserve.server.misfit import MAX_FIELD_NAME, find_misfit

MAX_ID_LENGTH = 256

# Error codes (the table in docs/websocket-protocol.md).
INVALID_JSON = "invalid_json"
UNKNOWN_TYPE = "unknown_type"
INVALID_FIELD = "invalid_field"
DUPLICATE_ID = "duplicate_id"
PROMPT_TOO_LONG = "prompt_too_long"
TOO_MANY_REQUESTS = "too_many_requests"
OVERLOADED = "overloaded"
SLOW_CONSUMER = "slow_consumer"
SHUTDOWN = "shutdown"
ENGINE_DEAD = "engine_dead"
REQUEST_FAILED = "request_failed"
INTERNAL = "internal"

_PARAM_FIELDS = frozenset(SamplingParams.__struct_fields__)
_GENERATE_FIELDS = frozenset({"type", "id", "prompt", "prompt_token_ids", "params", "stream_options"})
_STREAM_OPTIONS = frozenset({"include_resumes"})
_CANCEL_FIELDS = frozenset({"type", "id"})
_EMBED_FIELDS = frozenset({"type", "id", "prompt", "prompt_token_ids", "dimensions", "normalize"})


# --- client -> server -------------------------------------------------------


class _Prompted(msgspec.Struct, frozen=True):
    """A request's id and prompt: exactly one of ``prompt`` (a string) and
    ``prompt_token_ids`` (an array, whose items the engine checks) is set."""

    id: str
    prompt: str | None
    prompt_token_ids: list[Any] | None

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.prompt is not None else "prompt_token_ids"

    @property
    def the_prompt(self) -> str | list[Any]:
        if self.prompt is not None:
            return self.prompt
        assert self.prompt_token_ids is not None  # exactly one is set
        return self.prompt_token_ids


class Generate(_Prompted, frozen=True):
    """Start a generation request. ``include_resumes`` (``stream_options``):
    its deltas and ``done`` say how often it was resumed after its engine
    core died."""

    params: SamplingParams
    include_resumes: bool = False


class Embed(_Prompted, frozen=True):
    """Ask for the prompt's vector (``Engine.encode``: an embedding model)."""

    dimensions: int | None = None
    normalize: bool | None = None


class Cancel(msgspec.Struct, frozen=True):
    id: str


# --- server -> client -------------------------------------------------------


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


class Delta(msgspec.Struct, tag="delta", tag_field="type", omit_defaults=True):
    id: str
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs] | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None  # in the first delta, when asked for
    num_resumes: int | None = None  # when asked for (stream_options.include_resumes)


class Done(msgspec.Struct, tag="done", tag_field="type"):
    id: str
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    num_resumes: int | UnsetType = UNSET  # when asked for (stream_options.include_resumes)


class Error(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    id: str | None
    code: str
    message: str
    field: str | None = None


class Embedding(msgspec.Struct, tag="embedding", tag_field="type"):
    id: str
    embedding: list[float]
    usage: Usage


ServerMessage = Delta | Done | Embedding | Error


class ProtocolError(Exception):
    """A client message that cannot be served. ``id`` is the request it names
    (when it named one), ``field`` the offending field."""

    def __init__(self, code: str, message: str, *, id: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id
        self.field = field

    def to_message(self) -> Error:
        return Error(id=self.id, code=self.code, message=self.message, field=self.field)


_encoder = msgspec.json.Encoder()


def encode(message: ServerMessage) -> str:
    """A server message as the text of one WebSocket frame."""
    return _encoder.encode(message).decode()


def parse_client_message(frame: str | bytes) -> Generate | Embed | Cancel:
    """Parse one client frame. Raises ``ProtocolError`` for anything that is
    not a valid ``generate``, ``embed`` or ``cancel`` message."""
    if isinstance(frame, bytes):
        raise ProtocolError(INVALID_JSON, "messages are JSON text frames; got a binary frame")
    raw = _decode_json(frame)
    if not isinstance(raw, dict):
        raise ProtocolError(INVALID_JSON, f"a message is a JSON object, got {_json_type(raw)}")
    request_id = raw.get("id") if _is_valid_id(raw.get("id")) else None  # echoed only when it is one
    kind = raw.get("type")
    if kind == "generate":
        return _parse_generate(raw)
    if kind == "embed":
        return _parse_embed(raw)
    if kind == "cancel":
        _check_fields(raw, _CANCEL_FIELDS, "", request_id)
        return Cancel(id=_parse_id(raw))
    if "type" not in raw:
        raise ProtocolError(INVALID_FIELD, "type: missing", id=request_id, field="type")
    expected = "expected 'generate', 'embed' or 'cancel'"
    raise ProtocolError(UNKNOWN_TYPE, f"type: unknown message type {short_repr(kind)} ({expected})", id=request_id)


def _decode_json(frame: str) -> Any:
    """The JSON value of ``frame``. Raises ``ProtocolError`` (``invalid_json``)
    for malformed JSON, for nesting too deep to decode, and for a string that
    holds a lone UTF-16 surrogate (which msgspec reports as truncated input)."""
    try:
        return msgspec.json.decode(frame)
    except RecursionError:
        raise ProtocolError(INVALID_JSON, "malformed JSON: nested too deeply") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(INVALID_JSON, f"malformed JSON: {malformed_json_detail(frame, exc)}") from None


def malformed_json_detail(text: str | bytes, exc: Exception) -> str:
    """What is wrong with ``text``, which msgspec failed to decode with
    ``exc``. msgspec reports a string holding a lone UTF-16 surrogate (a
    ``\\ud800`` escape) as truncated input; this names it. (Used by the
    WebSocket and the HTTP API alike.)"""
    detail = str(exc).removeprefix("JSON is malformed: ")
    if _is_valid_json_with_a_lone_surrogate(text):
        detail = "invalid string: a \\u escape encodes a lone UTF-16 surrogate"
    return detail


def _is_valid_json_with_a_lone_surrogate(text: str | bytes) -> bool:
    """True when ``text`` is JSON that Python's parser (which allows lone
    surrogates, unlike msgspec) accepts. Only called after msgspec failed."""
    if "\\u" not in (text if isinstance(text, str) else text.decode("latin-1")):
        return False
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _parse_generate(raw: dict[str, Any]) -> Generate:
    request_id = _parse_id(raw)
    _check_fields(raw, _GENERATE_FIELDS, "", request_id)
    prompt, token_ids = _parse_prompt(raw, request_id)
    params = _parse_params(raw, request_id)
    options = raw.get("stream_options", {})
    if not isinstance(options, dict):
        raise _invalid(request_id, "stream_options", f"must be an object, got {_json_type(options)}")
    _check_fields(options, _STREAM_OPTIONS, "stream_options.", request_id)
    include_resumes = options.get("include_resumes", False)
    if not isinstance(include_resumes, bool):
        raise _invalid(
            request_id, "stream_options.include_resumes", f"must be a boolean, got {_json_type(include_resumes)}"
        )
    return Generate(
        id=request_id, prompt=prompt, prompt_token_ids=token_ids, params=params, include_resumes=include_resumes
    )


def _parse_embed(raw: dict[str, Any]) -> Embed:
    request_id = _parse_id(raw)
    _check_fields(raw, _EMBED_FIELDS, "", request_id)
    prompt, token_ids = _parse_prompt(raw, request_id)
    dimensions, normalize = raw.get("dimensions"), raw.get("normalize")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise _invalid(request_id, "dimensions", f"must be an integer, got {_json_type(dimensions)}")
    if normalize is not None and not isinstance(normalize, bool):
        raise _invalid(request_id, "normalize", f"must be a boolean, got {_json_type(normalize)}")
    return Embed(id=request_id, prompt=prompt, prompt_token_ids=token_ids, dimensions=dimensions, normalize=normalize)


def _parse_prompt(raw: dict[str, Any], request_id: str) -> tuple[str | None, list[Any] | None]:
    prompt, token_ids = raw.get("prompt"), raw.get("prompt_token_ids")
    if (prompt is None) == (token_ids is None):
        raise ProtocolError(
            INVALID_FIELD, "prompt: give exactly one of prompt and prompt_token_ids", id=request_id, field="prompt"
        )
    if prompt is not None and not isinstance(prompt, str):
        raise _invalid(request_id, "prompt", f"must be a string, got {_json_type(prompt)}")
    if token_ids is not None and not isinstance(token_ids, list):
        raise _invalid(request_id, "prompt_token_ids", f"must be an array of token ids, got {_json_type(token_ids)}")
    return prompt, token_ids


def _is_valid_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 1 <= len(value) <= MAX_ID_LENGTH


def _parse_id(raw: dict[str, Any]) -> str:
    value = raw.get("id")
    if "id" not in raw:
        raise ProtocolError(INVALID_FIELD, "id: missing", field="id")
    if not _is_valid_id(value):
        raise ProtocolError(
            INVALID_FIELD,
            f"id: must be a string of 1 to {MAX_ID_LENGTH} characters (got {short_repr(value)})",
            field="id",
        )
    return value


def _parse_params(raw: dict[str, Any], request_id: str) -> SamplingParams:
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise _invalid(request_id, "params", f"must be an object, got {_json_type(params)}")
    _check_fields(params, _PARAM_FIELDS, "params.", request_id)
    try:
        return msgspec.convert(params, SamplingParams, str_keys=True)  # JSON's keys: logit_bias's token ids
    except msgspec.ValidationError as exc:
        raise _params_error(params, exc, request_id) from None


def _params_error(params: dict[str, Any], exc: msgspec.ValidationError, request_id: str) -> ProtocolError:
    """The error for ``params``, which msgspec refused with ``exc``: a value
    out of range (``SamplingParams`` raised ``InvalidRequestError``, which
    msgspec keeps as the cause), else a value of the wrong JSON type, located
    by ``find_misfit``."""
    if isinstance(exc.__cause__, InvalidRequestError):
        cause = exc.__cause__
        return _invalid(request_id, f"params.{cause.field}", str(cause).removeprefix(f"{cause.field}: "))
    misfit = find_misfit(params, SamplingParams)
    if misfit is None:  # a type the walk does not know: msgspec's word, on params as a whole
        return _invalid(request_id, "params", str(exc))
    return _invalid(request_id, f"params.{misfit.path}", misfit.message)


def _check_fields(raw: dict[str, Any], known: frozenset[str], prefix: str, request_id: str | None) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        name = unknown[0] if len(unknown[0]) <= MAX_FIELD_NAME else unknown[0][:MAX_FIELD_NAME] + "..."
        raise _invalid(request_id, f"{prefix}{name}", "unknown field")


def _invalid(request_id: str | None, field: str, message: str) -> ProtocolError:
    return ProtocolError(INVALID_FIELD, f"{field}: {message}", id=request_id, field=field)


def _json_type(value: object) -> str:
    names = {
        list: "an array",
        dict: "an object",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def error(request_id: str | None, code: str, message: str) -> Error:
    return Error(id=request_id, code=code, message=message)


def done(
    request_id: str,
    finish_reason: Literal["stop", "length", "abort"] | str,
    stop_reason: str | int | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    num_resumes: int | None = None,
) -> Done:
    return Done(
        id=request_id,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens),
        num_resumes=UNSET if num_resumes is None else num_resumes,
    )
