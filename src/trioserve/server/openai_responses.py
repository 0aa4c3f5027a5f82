"""What the OpenAI-compatible API answers, as msgspec structs: responses,
stream chunks, usage, logprobs, models and error objects. No I/O, no trio.

Each struct's fields are declared in the order they go on the wire. A field
OpenAI sends as ``null`` is ``X | None`` and always sent; one that is left
out unless it applies (a chunk's ``usage`` without ``include_usage``, the
``role`` of a chat delta after the first) is ``UNSET`` by default, which
msgspec does not encode. ``http.encode_json`` gives the bytes.
"""

from __future__ import annotations

import codecs
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from msgspec import UNSET, UnsetType

from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import SampleLogprobs

if TYPE_CHECKING:
    from trioserve.api import Engine


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


# --- errors ----------------------------------------------------------------------------


class ErrorObject(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    """OpenAI's error object: ``{"error": {...}}``."""

    error: ErrorObject


# --- usage and logprobs ----------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions ``logprobs``: one list item per token (an
    echoed prompt's first token has none: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where the character holding the token's first byte starts


class PromptTokenLogprob(msgspec.Struct):
    """One token of a ``prompt_logprobs`` entry (vLLM's shape)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token, null for the first, else the
# token and the top alternatives by token id (as a string).
PromptLogprobsField = list[dict[str, PromptTokenLogprob] | None]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]  # the token's own bytes


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


# --- completions, chat completions and their chunks ---------------------------------------


class CompletionChoice(msgspec.Struct):
    """A choice of a completion, whole or in a chunk (the same shape)."""

    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    text: str
    prompt_logprobs: PromptLogprobsField | UnsetType = UNSET  # when asked for
    num_resumes: int | UnsetType = UNSET  # a chunk's, when asked for (stream_options.include_resumes)


class Completion(msgspec.Struct, kw_only=True):
    """A whole completion (``usage`` set), or one chunk of a stream
    (``usage`` ``UNSET``, or ``None`` but in the last chunk when the client
    asked for ``stream_options.include_usage``)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType | None = UNSET


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON text


class ToolCallObject(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCallObject] | UnsetType = UNSET  # when it called tools


class ChatChoice(msgspec.Struct):
    index: int
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    message: AssistantMessage


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField | UnsetType = UNSET  # when asked for


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    arguments: str
    name: str | UnsetType = UNSET  # in a call's first piece


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a call in a stream: a client joins the ``arguments`` of one ``index``."""

    index: int
    function: FunctionDelta
    id: str | UnsetType = UNSET  # in a call's first piece
    type: str | UnsetType = UNSET  # "function", in a call's first piece


class ChatDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET  # in a stream's opening chunks only
    content: str | None = None
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET  # pieces of calls, when tools are read


class ChatChunkChoice(msgspec.Struct):
    index: int
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    delta: ChatDelta
    num_resumes: int | UnsetType = UNSET  # when asked for (stream_options.include_resumes)


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One chunk of a chat stream; ``usage`` as in ``Completion``'s chunks."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET


# --- models and the engine's control calls --------------------------------------------------


class Model(msgspec.Struct, kw_only=True):
    """The served model, as ``GET /v1/models/{model}`` answers it."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "trioserve"
    max_model_len: int
    task: str = "generate"  # or "embed": what the model serves (/v1/completions and chat, or /v1/embeddings)
    parent: str | None = None  # a LoRA adapter's base model (server/lora_api.py)


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[Model]


def models_list(names: list[str], engine: Engine, created: int) -> ModelList:
    """The one model ``engine`` serves, under each of its ``names``."""
    max_model_len, task = engine.info.max_model_len, engine.supported_tasks[0]
    return ModelList(data=[Model(id=name, created=created, max_model_len=max_model_len, task=task) for name in names])


class EngineHealth(msgspec.Struct):
    """The answer to a control call, once it is done."""

    health: str


# --- logprobs: where each token stands in the text -------------------------------------------

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
    UTF-8 count as the U+FFFD the text shows for each. A token starting past
    the text so far is not taken: its text is still held back (the start of
    a stop string, say), or, at the sample's end, never shown. Positions
    count from the sample's start, so a token whose text was held back in
    part places the next one right."""

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


def completion_logprobs(placed: Placed, tokenizer: Tokenizer) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` for these tokens (``TokenPlacer``)."""
    return CompletionLogprobs(
        tokens=[_text(tokenizer, token_id) for token_id, _, _ in placed],
        token_logprobs=[lp.logprob for _, lp, _ in placed],
        top_logprobs=[
            {_text(tokenizer, t): p for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for _, lp, _ in placed
        ],
        text_offset=[before for _, _, before in placed],
    )


def chat_logprobs(placed: Placed, tokenizer: Tokenizer) -> ChatLogprobs:
    """The chat ``logprobs`` for these tokens (``TokenPlacer``). ``bytes``
    are each token's own bytes, so that a client can join those of a
    character spread over several tokens (whose ``token`` text alone is
    U+FFFD)."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(
            token=_text(tokenizer, token_id), logprob=logprob, bytes=list(tokenizer.token_bytes(token_id))
        )

    return ChatLogprobs(
        content=[
            TokenLogprob(
                token=_text(tokenizer, token_id),
                logprob=lp.logprob,
                bytes=list(tokenizer.token_bytes(token_id)),
                top_logprobs=[top(t, p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)],
            )
            for token_id, lp, _ in placed
        ]
    )


def prompt_logprobs_field(
    token_ids: Sequence[int], logprobs: Sequence[SampleLogprobs], tokenizer: Tokenizer
) -> PromptLogprobsField:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then for
    each the token itself and its top alternatives (``logprobs``: those of
    tokens 1, 2...), keyed by token id."""
    field: PromptLogprobsField = [None] if token_ids else []
    for token_id, lp in zip(token_ids[1:], logprobs, strict=False):
        entry = {str(token_id): PromptTokenLogprob(lp.logprob, lp.rank, _text(tokenizer, token_id))}
        for rank, (top_id, top_logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(str(top_id), PromptTokenLogprob(top_logprob, rank, _text(tokenizer, top_id)))
        field.append(entry)
    return field


def echoed_prompt_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[SampleLogprobs] | None,
    tokenizer: Tokenizer,
    *,
    special_tokens_shown: bool,
) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` of an echoed prompt: each token's
    text, where its character starts in the echoed text (which shows the
    special tokens' text or not, as ``special_tokens_shown``), its logprob
    (none for the first) and its top alternatives."""
    entries: list[SampleLogprobs | None] = [None, *(logprobs or [])][: len(token_ids)]
    return CompletionLogprobs(
        tokens=[_text(tokenizer, token_id) for token_id in token_ids],
        token_logprobs=[None if lp is None else lp.logprob for lp in entries],
        top_logprobs=[
            None
            if lp is None
            else {_text(tokenizer, t): p for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for lp in entries
        ],
        text_offset=_char_offsets(token_ids, tokenizer, special_tokens_shown),
    )


def _char_offsets(token_ids: Sequence[int], tokenizer: Tokenizer, special_tokens_shown: bool) -> list[int]:
    """Where each token's first character starts in the text of ``token_ids``
    (as ``TokenPlacer`` counts: bytes that are no UTF-8 count as U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    special = tokenizer.all_special_ids
    offsets, decoded = [], 0
    for token_id in token_ids:
        if token_id in special:
            data = _text(tokenizer, token_id).encode() if special_tokens_shown else b""
        else:
            data = tokenizer.token_bytes(token_id)
        pending = decoder.getstate()[0]
        offsets.append(decoded + (1 if pending and data and not _continues(pending, data[:1]) else 0))
        decoded += len(decoder.decode(data))
    return offsets
