"""Responses of the completions and chat endpoints, whole or as events.

``Choices`` gathers a parent request's samples as their deltas arrive;
``EventFormat`` (``CompletionFormat``, ``ChatFormat``) turns them into
OpenAI's objects (``openai_responses.py``): the whole response, and the
stream's chunks (``text_completion`` / ``chat.completion.chunk``). Plain
functions and state, no I/O.

What the format needs of the prompt (its text to echo, its token ids for
prompt logprobs, its length for a chunk's usage) is known once the request
is entered: ``EventFormat.prompt`` is set then, before any response.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from msgspec import UNSET, UnsetType

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import SampleLogprobs
from trioserve.server import openai_responses as resp
from trioserve.server.chat_tools import CallPiece, ToolOutput, ToolPlan, read_whole

Event = resp.Completion | resp.ChatCompletionChunk  # one chunk of a stream


@dataclass(frozen=True)
class PromptInfo:
    text: str  # as the client gave it, or decoded from its token ids
    token_ids: list[int]
    special_tokens_shown: bool = False  # the text shows its special tokens (decoded from token ids)


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None  # of prompt tokens 1, 2... (with the first output)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    placer: resp.TokenPlacer | None = None  # a stream's: which tokens' logprobs went out
    echoed: bool = False  # a stream's: the prompt went out before its text
    tools: ToolOutput | None = None  # a stream's: its output read for tool calls


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
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
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


class EventFormat(ABC):
    """One endpoint's responses and chunks: ``ChatFormat`` or ``CompletionFormat``."""

    id_prefix = ""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        *,
        continuous_usage: bool = False,
        prompt_logprobs: bool = False,
        include_resumes: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer  # for logprobs: each token's text and bytes
        self.id = resp.new_id(self.id_prefix)
        self.created = resp.now()
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self.include_resumes = include_resumes  # every chunk's choice says how often its request was resumed
        self.prompt_logprobs = prompt_logprobs  # the response carries vLLM's ``prompt_logprobs``
        self.prompt = PromptInfo("", [])  # set once the request is entered

    def _prompt_logprobs(self, choice: Choice) -> resp.PromptLogprobsField | UnsetType:
        if not self.prompt_logprobs:
            return UNSET
        return resp.prompt_logprobs_field(self.prompt.token_ids, choice.prompt_logprobs or [], self.tokenizer)

    def _placed(self, choice: Choice, placer: resp.TokenPlacer) -> resp.Placed | None:
        """``choice``'s tokens that ``placer`` has not taken yet and whose
        text has come (None when no logprobs were asked for)."""
        if choice.logprobs is None:
            return None
        return placer.place(choice.token_ids, choice.logprobs, len(choice.text))

    def _stream_placed(self, out: RequestOutput, choices: Choices) -> resp.Placed | None:
        """The placed tokens for one delta of one sample: those of earlier
        chunks whose text was held back, and this chunk's as far as the text
        goes (the rest wait for a later chunk; at the sample's end, those past
        its final text are left out)."""
        choice = choices.items[out.index]
        if choice.placer is None:
            choice.placer = resp.TokenPlacer(self.tokenizer)
        return self._placed(choice, choice.placer)

    def _whole_placed(self, choice: Choice) -> resp.Placed | None:
        return self._placed(choice, resp.TokenPlacer(self.tokenizer))

    @staticmethod
    def _usage(choices: Choices, prompt_tokens: int) -> resp.Usage:
        return resp.usage(prompt_tokens, choices.completion_tokens, choices.cached_tokens)

    def _chunk_usage(self, include_usage: bool, choice: Choice | None = None) -> resp.Usage | UnsetType | None:
        """A content chunk's ``usage``: with ``continuous_usage``, the
        prompt's and ``choice``'s tokens so far; else null when the last
        chunk brings it, or left out."""
        if include_usage and self.continuous_usage:
            return resp.usage(len(self.prompt.token_ids), choice.num_output_tokens if choice is not None else 0)
        return None if include_usage else UNSET

    def _resumes(self, out: RequestOutput) -> int | UnsetType:
        return out.num_resumes if self.include_resumes else UNSET

    @abstractmethod
    def response(self, choices: Choices, prompt_tokens: int) -> resp.Completion | resp.ChatCompletion:
        """The whole (non-streamed) response."""

    def opening(self, n: int, include_usage: bool) -> list[Event]:
        """The chunks sent before any token."""
        return []

    @abstractmethod
    def chunk(self, out: RequestOutput, choices: Choices, include_usage: bool) -> Event:
        """The chunk for one delta of one sample."""

    @abstractmethod
    def usage_chunk(self, choices: Choices, prompt_tokens: int) -> Event:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""


class CompletionFormat(EventFormat):
    """``/v1/completions``: ``text_completion`` objects, whole or as chunks."""

    id_prefix = "cmpl"

    def __init__(self, model: str, tokenizer: Tokenizer, *, echo: bool = False, **options: bool) -> None:
        super().__init__(model, tokenizer, **options)
        self.echo = echo  # the prompt before each choice's text (and its logprobs before theirs)

    def _logprobs(self, placed: resp.Placed | None, choice: Choice, echo: bool) -> resp.CompletionLogprobs | None:
        """The logprobs of ``placed``; with ``echo``, the prompt's first and
        the places counted in the echoed text."""
        if placed is None:
            return None
        if not echo:
            return resp.completion_logprobs(placed, self.tokenizer)
        shift = len(self.prompt.text)
        outputs = resp.completion_logprobs([(t, lp, before + shift) for t, lp, before in placed], self.tokenizer)
        prompt = resp.echoed_prompt_logprobs(
            self.prompt.token_ids,
            choice.prompt_logprobs,
            self.tokenizer,
            special_tokens_shown=self.prompt.special_tokens_shown,
        )
        return resp.CompletionLogprobs(
            tokens=prompt.tokens + outputs.tokens,
            token_logprobs=prompt.token_logprobs + outputs.token_logprobs,
            top_logprobs=prompt.top_logprobs + outputs.top_logprobs,
            text_offset=prompt.text_offset + outputs.text_offset,
        )

    def _body(self, choices: list[resp.CompletionChoice], usage: resp.Usage | UnsetType | None) -> resp.Completion:
        return resp.Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def response(self, choices: Choices, prompt_tokens: int) -> resp.Completion:
        items = []
        for index, c in enumerate(choices.items):
            logprobs = self._logprobs(self._whole_placed(c), c, self.echo)
            text = self.prompt.text + c.text if self.echo else c.text
            item = resp.CompletionChoice(index, logprobs, _finish(c.finish_reason), text, self._prompt_logprobs(c))
            items.append(item)
        return self._body(items, self._usage(choices, prompt_tokens))

    def chunk(self, out: RequestOutput, choices: Choices, include_usage: bool) -> resp.Completion:
        choice = choices.items[out.index]
        echo, choice.echoed = self.echo and not choice.echoed, choice.echoed or self.echo
        logprobs = self._logprobs(self._stream_placed(out, choices), choice, echo)
        text = self.prompt.text + out.text if echo else out.text
        item = resp.CompletionChoice(
            out.index, logprobs, _finish(out.finish_reason), text, num_resumes=self._resumes(out)
        )
        return self._body([item], self._chunk_usage(include_usage, choice))

    def usage_chunk(self, choices: Choices, prompt_tokens: int) -> resp.Completion:
        return self._body([], self._usage(choices, prompt_tokens))


class ChatFormat(EventFormat):
    """``/v1/chat/completions``: a ``chat.completion``, or
    ``chat.completion.chunk`` objects opened by one per choice giving its role."""

    id_prefix = "chatcmpl"

    def _logprobs(self, placed: resp.Placed | None) -> resp.ChatLogprobs | None:
        return None if placed is None else resp.chat_logprobs(placed, self.tokenizer)

    def _chunk(
        self, items: list[resp.ChatChunkChoice], usage: resp.Usage | UnsetType | None
    ) -> resp.ChatCompletionChunk:
        return resp.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=items, usage=usage)

    def __init__(self, model: str, tokenizer: Tokenizer, *, tools: ToolPlan | None = None, **options: bool) -> None:
        super().__init__(model, tokenizer, **options)
        self.tools = tools if tools is not None and tools.reads_calls else None  # the output read for calls

    def _message(self, c: Choice) -> tuple[resp.AssistantMessage, str | None]:
        if self.tools is None:
            return resp.AssistantMessage(role="assistant", content=c.text), c.finish_reason
        content, calls, reason = read_whole(self.tools, c.text, c.finish_reason)
        if not calls:
            return resp.AssistantMessage(role="assistant", content=content), reason
        objects = [
            resp.ToolCallObject(id=p.id or "", function=resp.FunctionCall(name=p.name or "", arguments=p.arguments))
            for p in calls
        ]
        return resp.AssistantMessage(role="assistant", content=content, tool_calls=objects), reason

    def response(self, choices: Choices, prompt_tokens: int) -> resp.ChatCompletion:
        items = []
        for index, c in enumerate(choices.items):
            message, reason = self._message(c)
            items.append(resp.ChatChoice(index, self._logprobs(self._whole_placed(c)), _finish(reason), message))
        usage = self._usage(choices, prompt_tokens)
        return resp.ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=items, usage=usage,
            prompt_logprobs=self._prompt_logprobs(choices.items[0]),
        )  # fmt: skip

    def opening(self, n: int, include_usage: bool) -> list[Event]:
        """Each choice's role, before any token."""
        delta = resp.ChatDelta(role="assistant", content="")
        usage = self._chunk_usage(include_usage)
        return [self._chunk([resp.ChatChunkChoice(index, None, None, delta)], usage) for index in range(n)]

    def chunk(self, out: RequestOutput, choices: Choices, include_usage: bool) -> resp.ChatCompletionChunk:
        logprobs = self._logprobs(self._stream_placed(out, choices))
        choice = choices.items[out.index]
        delta, reason = resp.ChatDelta(content=out.text), out.finish_reason
        if self.tools is not None:
            if choice.tools is None:
                choice.tools = ToolOutput(self.tools)
            content, pieces = choice.tools.feed(out.text, last=out.finished)
            delta = resp.ChatDelta(content=content if content or not pieces else None)
            if pieces:
                delta.tool_calls = [_call_delta(p) for p in pieces]
            reason = choice.tools.finish_reason(out.finish_reason)
        item = resp.ChatChunkChoice(out.index, logprobs, _finish(reason), delta, self._resumes(out))
        return self._chunk([item], self._chunk_usage(include_usage, choice))

    def usage_chunk(self, choices: Choices, prompt_tokens: int) -> resp.ChatCompletionChunk:
        return self._chunk([], self._usage(choices, prompt_tokens))


def _call_delta(piece: CallPiece) -> resp.ToolCallDelta:
    if piece.id is None:
        return resp.ToolCallDelta(index=piece.index, function=resp.FunctionDelta(arguments=piece.arguments))
    function = resp.FunctionDelta(arguments=piece.arguments, name=piece.name or "")
    return resp.ToolCallDelta(index=piece.index, function=function, id=piece.id, type="function")


def _finish(reason: str | None) -> str | None:
    """OpenAI's finish reasons are ``stop``, ``length`` and ``tool_calls``
    (the server answers an engine's abort with an error instead:
    ``grace.check_not_aborted``)."""
    return reason


def chat_format(model: str, tokenizer: Tokenizer, tools: ToolPlan | None = None, **options: bool) -> ChatFormat:
    """Options: ``continuous_usage``, ``prompt_logprobs``, ``include_resumes`` (``EventFormat``);
    ``tools``: the request's, whose output is read for calls."""
    return ChatFormat(model, tokenizer, tools=tools, **options)


def completion_format(model: str, tokenizer: Tokenizer, **options: bool) -> CompletionFormat:
    """Options: ``echo`` and those of ``chat_format``."""
    return CompletionFormat(model, tokenizer, **options)
