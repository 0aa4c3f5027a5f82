"""The OpenAI-compatible HTTP API's requests as plain functions: bodies in,
checked, and what to ask the engine for out; errors as ``OpenAIError``.
No I/O, no trio. What it answers is in ``openai_responses.py``.

Request bodies are decoded into msgspec structs: a field of the wrong JSON
type, or a missing one, is an error naming it with its path (as in the
WebSocket protocol), found by ``misfit.py`` from the types' structure. A
field the API does not know is ignored, as OpenAI-compatible servers do
(clients send ``metadata``, ``store``, ``user``... and rely on it), with one
warning line per field name at most every ``IGNORED_LOG_INTERVAL_S``; with
``strict`` (``--strict-fields``) it is an error naming it. What the values mean is checked once, by the
engine (``SamplingParams`` and ``Engine.stream``); ``OpenAIError.from_engine``
maps its ``InvalidRequestError`` to OpenAI's error object, with the
client's own name for the field. docs/openai-api.md lists what is
supported and how it differs from OpenAI's API.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Literal

import msgspec

from trioserve.errors import InvalidRequestError, PromptTooLongError
from trioserve.sampling_params import MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS, SamplingParams
from trioserve.server.chat_tools import ToolPlan, plan_tools, template_messages
from trioserve.server.misfit import Misfit, find_misfit, unknown_fields
from trioserve.server.openai_responses import ErrorBody, ErrorObject
from trioserve.server.openai_structured import StructuredError, StructuredFields, requested_constraint
from trioserve.server.protocol import malformed_json_detail

log = logging.getLogger("trioserve.openai")
IGNORED_LOG_INTERVAL_S = 600.0  # an ignored field's name is logged at most this often
MAX_IGNORED_NAMES = 256  # names remembered for that (then forgotten, all at once)

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

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code))

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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    include_resumes: bool = False  # trioserve's: each chunk's choice says how often its request was resumed


class _Sampling(StructuredFields, kw_only=True):
    """Fields shared by both endpoints (with those asking for a structured
    output: ``openai_structured.py``); ``None`` means "not given"."""

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
    logit_bias: dict[str, float] | None = None  # token ids (as strings) to biases, clamped to [-100, 100]
    user: str | None = None  # accepted, unused
    # vLLM's sampling parameters (not OpenAI's):
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a batch of one of either
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (and its logprobs, with logprobs)
    best_of: int | None = None  # accepted only equal to n
    suffix: str | None = None  # accepted only empty


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class CalledTool(msgspec.Struct):
    """A call in an assistant message of the history (``tool_calls[i]``)."""

    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[CalledTool] | None = None  # an assistant message: the calls it made

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by chat_tools.plan_tools
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # accepted, unused
    # vLLM's chat-template fields (ChatTemplate.render):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: given to the chat template, as a chat request's
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[int]


def decode_body(body: bytes, kind: type[msgspec.Struct], *, strict: bool = False) -> Any:
    """The request body as a ``kind``. Raises ``OpenAIError`` (400) naming
    the offending field: malformed JSON, a wrong type, a missing field, and
    with ``strict`` an unknown one (else ignored, and logged)."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        refused = exc  # located below, from the body's plain JSON value
    except (RecursionError, UnicodeDecodeError, msgspec.DecodeError) as exc:
        raise _malformed(body, exc) from None
    else:
        unknown = unknown_fields(msgspec.json.decode(body), kind)
        if unknown and strict:
            raise invalid(unknown[0], "unknown field", code="unknown_field")
        _IGNORED.note(unknown)
        return request
    try:
        value = msgspec.json.decode(body)
    except (RecursionError, UnicodeDecodeError, msgspec.DecodeError) as exc:
        raise _malformed(body, exc) from None  # malformed past where the typed decode stopped
    raise _misfit_error(find_misfit(value, kind), refused) from None


class _IgnoredFields:
    """Logs the fields ignored, one line per name (indexes left out: ``messages[].x``)
    at most every ``IGNORED_LOG_INTERVAL_S``, so a client cannot fill the log."""

    def __init__(self) -> None:
        self._logged_at: dict[str, float] = {}

    def note(self, paths: list[str]) -> None:
        now = time.monotonic()
        for path in paths:
            name = re.sub(r"\[[^\]]*\]", "[]", path)
            if now - self._logged_at.get(name, -IGNORED_LOG_INTERVAL_S) < IGNORED_LOG_INTERVAL_S:
                continue
            if len(self._logged_at) >= MAX_IGNORED_NAMES:
                self._logged_at.clear()
            self._logged_at[name] = now
            log.warning(
                "ignored the request field %r, which this server does not use (--strict-fields refuses it)", name
            )


_IGNORED = _IgnoredFields()


def _malformed(body: bytes, exc: Exception) -> OpenAIError:
    if isinstance(exc, RecursionError):
        detail = "nested too deeply"
    elif isinstance(exc, UnicodeDecodeError):  # msgspec decodes strings as it goes, and raises this unwrapped
        detail = f"not UTF-8 ({exc.reason} at byte {exc.start})"
    else:
        detail = malformed_json_detail(body, exc)
    return OpenAIError(400, f"malformed JSON: {detail}", code="invalid_json")


def _misfit_error(misfit: Misfit | None, refused: msgspec.ValidationError) -> OpenAIError:
    if misfit is None:  # a type the walk does not know: msgspec's word, without a field
        return OpenAIError(400, f"the body does not fit the API: {refused}", code="invalid_type")
    if not misfit.path:
        return OpenAIError(400, f"the body must be a JSON object: {misfit.message}", code="invalid_json")
    return invalid(misfit.path, misfit.message, code=misfit.kind)


# --- to the engine -----------------------------------------------------------------


class Plan(msgspec.Struct, frozen=True):
    """What a request asks the engine for, and how to answer it."""

    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    names: dict[str, str]  # engine field -> the client's name for it
    continuous_usage: bool = False  # the usage so far in every chunk (``stream_options.continuous_usage_stats``)
    include_resumes: bool = False  # each chunk's choice has its num_resumes (``stream_options.include_resumes``)
    echo: bool = False  # completions: the prompt before each choice's text
    prompt_logprobs: bool = False  # the response carries vLLM's ``prompt_logprobs`` (the client asked for them)
    tools: ToolPlan | None = None  # chat: the request's tools (``chat_tools.py``)


def plan_completion(request: CompletionRequest) -> Plan:
    if request.suffix:
        raise invalid("suffix", "not supported", code="unsupported")
    if request.best_of is not None and request.best_of != request.n:
        raise invalid("best_of", "not supported (other than equal to n)", code="unsupported")
    names = {"prompt": "prompt", "max_tokens": "max_tokens"}
    params = _sampling_params(request, names, max_tokens=request.max_tokens, logprobs=request.logprobs, default_max=16)
    if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
        # The echoed prompt's tokens come with logprobs too.
        names["prompt_logprobs"] = "logprobs"
        params = msgspec.structs.replace(params, prompt_logprobs=request.logprobs)
    return _plan(request, params, names, echo=request.echo)


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one (a string or token ids), or
    a batch (a list of strings, or of token-id lists). A batch's samples are
    the response's choices, prompt by prompt; ``echo`` and
    ``prompt_logprobs`` are for one prompt."""
    prompt: Any = request.prompt
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [prompt]  # the engine checks a list's items
    if not all(isinstance(item, type(prompt[0])) for item in prompt):
        raise invalid("prompt", "a batch is a list of strings or a list of token-id lists, not both")
    if len(prompt) > 1:
        if request.echo:
            raise invalid("echo", "not with a batch of prompts (give one prompt per request)", code="unsupported")
        if request.prompt_logprobs is not None:
            raise invalid("prompt_logprobs", "not with a batch of prompts (give one prompt per request)", "unsupported")
    return list(prompt)


def plan_chat(request: ChatCompletionRequest, max_model_len: int, *, tool_call_parser: str | None = None) -> Plan:
    """``tool_call_parser``: the server's, for ``tool_choice: "auto"`` (None: refused)."""
    try:
        tools = plan_tools(request.tools, request.tool_choice, parser=tool_call_parser)
    except InvalidRequestError as exc:
        raise OpenAIError.from_engine(exc, {}) from None
    for i, message in enumerate(request.messages):
        if message.tool_calls and message.role != "assistant":
            raise invalid(
                f"messages[{i}].tool_calls", f"only an assistant message makes calls (this one is {message.role!r})"
            )
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    if not request.messages:
        raise invalid("messages", "must not be empty")
    given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    names = {"prompt": "messages", "max_tokens": given, "logprobs": "top_logprobs"}
    params = _sampling_params(request, names, max_tokens=max_tokens, logprobs=logprobs, default_max=max_model_len)
    if tools is not None and (constraint := tools.constraint()) is not None:
        if params.structured is not None:
            raise invalid(names["structured"], "not with tool_choice 'required' or a named function (one constraint)")
        names["structured"] = tools.param
        params = msgspec.structs.replace(params, structured=constraint)
    return _plan(request, params, names, tools=tools)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them."""
    messages = []
    for message in request.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ]
        messages.append(item)
    return template_messages(messages)


def _logit_bias(given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids written as strings) as the engine
    takes it, each bias clamped to [-100, 100] as vLLM does."""
    bias = {}
    for key, value in (given or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid("logit_bias", f"keys must be token ids written as strings (got {key[:40]!r})")
        bias[int(key)] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, value))
    return bias


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
    if len(request.logit_bias or ()) > MAX_LOGIT_BIAS:  # refused before its keys are looked at
        raise invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} entries (got {len(request.logit_bias or ())})")
    try:
        structured, names["structured"] = requested_constraint(request)
    except StructuredError as exc:
        raise invalid(exc.param, exc.message) from None
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            seed=request.seed,
            stop=stop,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids or []),
            include_stop_str_in_output=request.include_stop_str_in_output,
            prompt_logprobs=request.prompt_logprobs,
            logit_bias=_logit_bias(request.logit_bias),
            bad_words=list(request.bad_words or []),
            allowed_token_ids=request.allowed_token_ids,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured=structured,
            **{name: value for name, value in given.items() if value is not None},
        )
    except InvalidRequestError as exc:
        raise OpenAIError.from_engine(exc, names) from None


def _plan(
    request: _Sampling,
    params: SamplingParams,
    names: dict[str, str],
    *,
    echo: bool = False,
    tools: ToolPlan | None = None,
) -> Plan:
    options = request.stream_options
    if options is not None and not request.stream:
        raise invalid("stream_options", "only with stream: true")
    if request.stream and request.prompt_logprobs is not None:
        raise invalid("prompt_logprobs", "not available with stream: true", code="unsupported")
    return Plan(
        params=params,
        n=request.n,
        stream=request.stream,
        include_usage=options is not None and options.include_usage,
        names=names,
        continuous_usage=options is not None and options.continuous_usage_stats,
        include_resumes=options is not None and options.include_resumes,
        echo=echo,
        prompt_logprobs=request.prompt_logprobs is not None,
        tools=tools,
    )
