"""The OpenAI-compatible HTTP API as plain functions: request bodies in,
checked; responses, stream chunks and error objects out. No I/O, no trio.

Request bodies are decoded into msgspec structs: a field of the wrong JSON
type, or one that the API does not know, is an error naming it (as in the
WebSocket protocol). What the values mean is checked once, by the engine
(``SamplingParams`` and ``Engine.stream``); ``OpenAIError.from_engine``
maps its ``InvalidRequestError`` to OpenAI's error object, with the
client's own name for the field. docs/openai-api.md lists what is
supported and how it differs from OpenAI's API.
"""

from __future__ import annotations

import codecs
import re
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from trioserve.errors import InvalidRequestError, PromptTooLongError
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import SampleLogprobs, SamplingParams
from trioserve.server.protocol import malformed_json_detail

# --- errors ---------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered with OpenAI's error object and an HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_engine(cls, exc: InvalidRequestError, names: dict[str, str]) -> OpenAIError:
        """The 400 for the engine's error: its field (``prompt``, ``max_tokens``...)
        renamed to the client's (``names``), in the message too."""
        param = names.get(exc.field, exc.field)
        message = param + str(exc).removeprefix(exc.field)
        code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "invalid_value"
        return cls(400, message, param=param, code=code)


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


# --- request bodies -----------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by both endpoints; ``None`` means "not given"."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's (as in vLLM)
    min_p: float | None = None  # not OpenAI's
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # not OpenAI's
    ignore_eos: bool = False  # not OpenAI's
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # accepted only empty
    user: str | None = None  # accepted, unused


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a batch of one of either
    logprobs: int | None = None
    echo: bool = False  # accepted only false
    best_of: int | None = None  # accepted only equal to n
    suffix: str | None = None  # accepted only empty


class TextPart(msgspec.Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # accepted only {"type": "text"}
    tools: list[Any] | None = None  # accepted only empty
    tool_choice: Any = None  # accepted only "none" or absent
    parallel_tool_calls: bool | None = None  # accepted, unused


_AT_PATH = re.compile(r"^(?P<message>.*) - at `\$(?P<path>[^`]*)`$", re.S)
# A client's key may hold backticks itself: the name runs to the last one.
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The request body as a ``kind``. Raises ``OpenAIError`` (400) naming
    the offending field: malformed JSON, a wrong type, an unknown field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise OpenAIError(400, "malformed JSON: nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError as exc:  # msgspec decodes strings as it goes, and raises this unwrapped
        raise OpenAIError(
            400, f"malformed JSON: not UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_json"
        ) from None
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"malformed JSON: {malformed_json_detail(body, exc)}", code="invalid_json") from None


def _validation_error(text: str) -> OpenAIError:
    path, message = "", text
    if match := _AT_PATH.match(text):
        path, message = match["path"].lstrip("."), match["message"]
    if match := _UNKNOWN.match(message):
        field = _join(path, match["name"][:64])
        return invalid(field, "unknown field", code="unknown_field")
    if match := _MISSING.match(message):
        return invalid(_join(path, match["name"]), "missing", code="missing_field")
    if not path:
        return OpenAIError(
            400, f"the body must be a JSON object: {message[0].lower()}{message[1:200]}", code="invalid_json"
        )
    return invalid(path, message[0].lower() + message[1:200], code="invalid_type")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- to the engine -----------------------------------------------------------------


class Plan(msgspec.Struct, frozen=True):
    """What a request asks the engine for, and how to answer it."""

    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    names: dict[str, str]  # engine field -> the client's name for it


def plan_completion(request: CompletionRequest) -> Plan:
    _check_unsupported(request)
    if request.echo:
        raise invalid("echo", "not supported", code="unsupported")
    if request.suffix:
        raise invalid("suffix", "not supported", code="unsupported")
    if request.best_of is not None and request.best_of != request.n:
        raise invalid("best_of", "not supported (other than equal to n)", code="unsupported")
    names = {"prompt": "prompt", "max_tokens": "max_tokens"}
    params = _sampling_params(request, names, max_tokens=request.max_tokens, logprobs=request.logprobs, default_max=16)
    return _plan(request, params, names)


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a string or token ids)."""
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("prompt", "give one prompt per request (batches of prompts are not supported)", "unsupported")
        prompt = prompt[0]
    return prompt  # type: ignore[no-any-return]  # the engine checks a list's items


def plan_chat(request: ChatCompletionRequest, max_model_len: int) -> Plan:
    _check_unsupported(request)
    if request.response_format is not None and request.response_format.type != "text":
        raise invalid("response_format", "only {'type': 'text'} is supported", code="unsupported")
    if request.tools:
        raise invalid("tools", "tool calls are not supported", code="unsupported")
    if request.tool_choice not in (None, "none"):
        raise invalid("tool_choice", "tool calls are not supported", code="unsupported")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    if not request.messages:
        raise invalid("messages", "must not be empty")
    given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    names = {"prompt": "messages", "max_tokens": given, "logprobs": "top_logprobs"}
    params = _sampling_params(request, names, max_tokens=max_tokens, logprobs=logprobs, default_max=max_model_len)
    return _plan(request, params, names)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them."""
    messages = []
    for message in request.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        messages.append(item)
    return messages


def _check_unsupported(request: _Sampling) -> None:
    if request.logit_bias:
        raise invalid("logit_bias", "not supported", code="unsupported")


def _sampling_params(
    request: _Sampling, names: dict[str, str], *, max_tokens: int | None, logprobs: int | None, default_max: int
) -> SamplingParams:
    """The engine's parameters; an ``OpenAIError`` naming the client's field (``names``)."""
    given: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            seed=request.seed,
            stop=stop,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            **{name: value for name, value in given.items() if value is not None},
        )
    except InvalidRequestError as exc:
        raise OpenAIError.from_engine(exc, names) from None


def _plan(request: _Sampling, params: SamplingParams, names: dict[str, str]) -> Plan:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "only with stream: true")
    return Plan(params=params, n=request.n, stream=request.stream, include_usage=include_usage, names=names)


# --- responses -----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt
    tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_entry(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    """The served model, as ``GET /v1/models/{model}`` answers it."""
    return {"id": model, "object": "model", "created": created, "owned_by": "trioserve", "max_model_len": max_model_len}


def models_list(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(model, max_model_len, created)]}


Placed = list[tuple[int, SampleLogprobs, int]]  # (token id, its logprobs, characters before it)


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class TokenPlacer:
    """Where a sample's tokens stand in its text, as the text comes (a
    stream's chunks) or all at once: ``place`` takes the tokens whose text
    has come, each with how many characters of the sample's text come before
    it (the characters its first byte's character starts after: a
    character's bytes may be spread over several tokens, and chunks).

    Special tokens (the end-of-sequence token that ended a reply, say) are
    never placed, as the text is decoded without them. Bytes that are no
    UTF-8 count as the U+FFFD the text shows for each (found: they counted
    as none, and every later offset fell behind). A token starting past the
    text so far is not taken: its text is still held back (the start of a
    stop string, say), or, at the sample's end, never shown (found: a stop
    string's tokens were listed though the text leaves them out). Positions
    count from the sample's start, so a token whose text was held back in
    part places the next one right (found: it was placed at its chunk's
    start)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoded = 0  # characters the bytes of the tokens taken have given
        self.num_taken = 0  # tokens taken (placed, or special)

    def place(self, token_ids: Sequence[int], logprobs: Sequence[SampleLogprobs], text_length: int) -> Placed:
        """The tokens of ``token_ids`` (all of the sample's so far, with
        their ``logprobs``) not taken yet whose character starts within the
        sample's first ``text_length`` characters."""
        placed: Placed = []
        for token_id, lp in zip(token_ids[self.num_taken :], logprobs[self.num_taken :], strict=True):
            data = b"" if token_id in self._tokenizer.all_special_ids else self._tokenizer.token_bytes(token_id)
            before = self._decoded
            pending = self._decoder.getstate()[0]  # the start of a character, still open
            if pending and data and not _continues(pending, data[:1]):
                before += 1  # that start is a U+FFFD of its own, before this token's first byte
            if before >= text_length:
                break
            if data:
                placed.append((token_id, lp, before))
                self._decoded += len(self._decoder.decode(data))
            self.num_taken += 1
        return placed


def _continues(start: bytes, byte: bytes) -> bool:
    """Whether ``byte`` goes on the UTF-8 character that ``start`` begins."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(start + byte)
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(placed: Placed, tokenizer: Tokenizer) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for these tokens
    (``TokenPlacer``). A token's ``text_offset`` is where the character
    holding its first byte starts in the choice's text."""
    return {
        "tokens": [_text(tokenizer, token_id) for token_id, _, _ in placed],
        "token_logprobs": [lp.logprob for _, lp, _ in placed],
        "top_logprobs": [
            {_text(tokenizer, t): p for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for _, lp, _ in placed
        ],
        "text_offset": [before for _, _, before in placed],
    }


def chat_logprobs(placed: Placed, tokenizer: Tokenizer) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) for these tokens
    (``TokenPlacer``). ``bytes`` are each token's own bytes, so that a client
    can join those of a character spread over several tokens (whose
    ``token`` text alone is U+FFFD)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": _text(tokenizer, token_id), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}

    content = []
    for token_id, lp, _ in placed:
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
        content.append(item)
    return {"content": content}
