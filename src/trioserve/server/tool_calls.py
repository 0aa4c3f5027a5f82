"""Tool calls in the OpenAI API: the ``tools`` a request offers, checked;
the schema that a forced call (``tool_choice`` ``"required"`` or a named
function) constrains the output to; and the parsers that find the calls in
what a model wrote by itself (``tool_choice`` ``"auto"``), whole or as a
stream.

Two formats of model output are read (``--tool-call-parser``, vLLM's names):

- ``hermes`` (Hermes, Qwen 2.5 and 3, and every template written after them):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a
  call, text before the first block being the reply's content;
- ``llama3_json`` (Llama 3.1 to 3.3): the whole reply is one or more JSON
  objects ``{"name": ..., "parameters": {...}}`` separated by ``;``,
  optionally after ``<|python_tag|>``.

What does not parse stays the reply's content: a call is never invented,
and no text is lost. A streamed call is sent as one delta once its block is
complete (its name and whole arguments); OpenAI's clients join the
``arguments`` of the deltas of one ``index``, so one delta is a valid stream.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trioserve.errors import InvalidRequestError

MAX_TOOLS = 128  # functions offered by one request
MAX_TOOL_NAME_CHARS = 64  # OpenAI's bound
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# tool_choice "required": the output is a JSON array of calls, each one of the functions with its parameters.
MAX_CALLS_REQUIRED = 16


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` as a JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        return self if self.id else ToolCall(self.name, self.arguments, f"chatcmpl-tool-{secrets.token_hex(16)}")


@dataclass(frozen=True)
class Function:
    """A function a request offers (``tools[i].function``), checked."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[Function]:
    """The functions of a request's ``tools``; ``InvalidRequestError``
    naming ``tools[i]...`` for one that is not a function with a valid name
    and a JSON-schema object as its parameters (whether the schema itself
    compiles is the grammar engine's to say, when it is used)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools (got {len(tools)})")
    functions: list[Function] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type", f"must be 'function' (got {tool.get('type')!r})")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{where}.function", "must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name", f"must be 1 to {MAX_TOOL_NAME_CHARS} of a-z, A-Z, 0-9, _ and - (got {name!r})"
            )
        if name in seen:
            raise InvalidRequestError(f"{where}.function.name", f"{name!r} is offered twice")
        seen.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON schema (an object)")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description", "must be a string")
        functions.append(Function(name, dict(parameters), description))
    return functions


def chosen_function(tool_choice: object, functions: Sequence[Function]) -> Function | str:
    """What ``tool_choice`` asks for: ``"none"``, ``"auto"``, ``"required"``,
    or the named ``Function``; ``InvalidRequestError`` for anything else, or
    a name that ``tools`` does not offer."""
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not functions:
            raise InvalidRequestError("tool_choice", "'required' needs at least one tool in 'tools'")
        return str(tool_choice)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        for offered in functions:
            if offered.name == name:
                return offered
        offered_names = ", ".join(repr(f.name) for f in functions) or "none"
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not among the tools ({offered_names})")
    raise InvalidRequestError(
        "tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


def required_schema(functions: Sequence[Function]) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s output: an array of
    one to ``MAX_CALLS_REQUIRED`` calls, each ``{"name": N, "parameters":
    P}`` for one of ``functions``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": f.parameters},
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_CALLS_REQUIRED,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }


def forced_calls(choice: Function | str, text: str) -> list[ToolCall]:
    """The calls in ``text``, the output constrained for ``choice`` (a named
    function: its arguments; ``"required"``: ``required_schema``'s array).
    Empty when the text does not parse (the output ran out of tokens first)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(choice, Function):
        return [ToolCall(choice.name, _json(value)).with_id()]
    if not isinstance(value, list):
        return []
    return [
        ToolCall(call["name"], _json(call.get("parameters", {}))).with_id()
        for call in value
        if isinstance(call, dict) and isinstance(call.get("name"), str)
    ]


def _json(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# --- What a model wrote by itself ("auto") -------------------------------------


@dataclass(frozen=True)
class Parsed:
    """A whole reply: its ``content`` (None when it was only calls) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class CallDelta:
    """A call found in a stream: its ``index`` among the reply's calls."""

    index: int
    call: ToolCall


class ToolCallStream(Protocol):
    """Text in, as the model writes it; out: content text and calls, in order."""

    def feed(self, text: str) -> list[str | CallDelta]: ...

    def finish(self) -> list[str | CallDelta]: ...


def _call_from(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments" if arguments_key != "arguments" else "parameters", {}))
    return ToolCall(obj["name"], _json(arguments)).with_id()


class HermesStream:
    """``<tool_call>{...}</tool_call>`` blocks; text outside them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._num_calls = 0

    def feed(self, text: str) -> list[str | CallDelta]:
        self._buffer += text
        out: list[str | CallDelta] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    _add_text(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                _add_text(out, self._buffer[:at])
                self._buffer = self._buffer[at + len(self.OPEN) :]
                self._in_call = True
            else:
                at = self._buffer.find(self.CLOSE)
                if at < 0:
                    return out
                out.append(self._call_or_text(self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.CLOSE) :]
                self._in_call = False

    def finish(self) -> list[str | CallDelta]:
        out: list[str | CallDelta] = []
        if self._in_call:  # the model stopped before closing its block: a call if it parses
            out.append(self._call_or_text(self._buffer, unclosed=True))
        else:
            _add_text(out, self._buffer)
        self._buffer = ""
        return out

    def _call_or_text(self, body: str, *, unclosed: bool = False) -> str | CallDelta:
        try:
            call = _call_from(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return self.OPEN + body + ("" if unclosed else self.CLOSE)
        self._num_calls += 1
        return CallDelta(self._num_calls - 1, call)


class Llama3JsonStream:
    """A reply that begins with ``{`` (or ``<|python_tag|>``) is calls,
    ``;``-separated JSON objects; any other reply is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # "calls" or "content", once the reply's start tells

    def feed(self, text: str) -> list[str | CallDelta]:
        if self._mode == "content":
            return [text] if text else []
        self._buffer += text
        if self._mode is None:
            start = self._buffer.lstrip()
            if not start or (self.TAG.startswith(start) and start != self.TAG):
                return []  # not yet known
            self._mode = "calls" if start.startswith(("{", self.TAG)) else "content"
            if self._mode == "content":
                text, self._buffer = self._buffer, ""
                return [text]
        return []

    def finish(self) -> list[str | CallDelta]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return [text] if text else []
        calls = _json_objects(text.strip().removeprefix(self.TAG))
        if calls is None:
            return [text]
        return [CallDelta(i, call) for i, call in enumerate(calls)]


def _json_objects(text: str) -> list[ToolCall] | None:
    """Calls written as ``{...}; {...}``, or None when any part does not parse."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or (text[at] == ";" and calls)):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_from(obj, "parameters")
        if call is None:
            return None
        calls.append(call)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _add_text(out: list[str | CallDelta], text: str) -> None:
    if text:
        out.append(text)


TOOL_CALL_PARSERS: dict[str, type[HermesStream] | type[Llama3JsonStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
}


def open_stream(parser: str) -> ToolCallStream:
    """A stream parser of ``parser`` (one of ``TOOL_CALL_PARSERS``)."""
    return TOOL_CALL_PARSERS[parser]()


def parse(parser: str, text: str) -> Parsed:
    """A whole reply's content and calls, read with ``parser``."""
    stream = open_stream(parser)
    pieces = [*stream.feed(text), *stream.finish()]
    calls = [piece.call for piece in pieces if isinstance(piece, CallDelta)]
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    if calls:
        content = content.strip()
    return Parsed(content or None, calls)
