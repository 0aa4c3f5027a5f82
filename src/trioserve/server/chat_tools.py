"""Tool calling on ``/v1/chat/completions``: what a request's ``tools`` and
``tool_choice`` ask of the chat template and the engine (``plan_tools``),
and each choice's output read back as content and calls (``ToolOutput``).

- ``"none"``: the tools go to the chat template (it may describe them), the
  output is content.
- ``"auto"``: the model decides; its own format of call is read by the
  server's ``--tool-call-parser`` (``tool_calls.py``). Refused unless the
  server was started with ``--enable-auto-tool-choice`` and a parser, as
  vLLM does; with ``tools`` and no ``tool_choice``, ``"auto"`` is meant.
- ``"required"`` and a named function: the output is constrained to a
  valid call (the engine's structured outputs), so any model makes one.
  A named function's output is its arguments, streamed as they come;
  ``"required"``'s is an array of calls, sent once it is complete.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trioserve.errors import InvalidRequestError
from trioserve.server.tool_calls import (
    CallDelta,
    Function,
    ToolCall,
    ToolCallStream,
    check_tools,
    chosen_function,
    forced_calls,
    open_stream,
    required_schema,
)
from trioserve.structured import JsonSchema, StructuredOutput

AUTO_NEEDS = '"auto" tool choice needs a server started with --enable-auto-tool-choice and --tool-call-parser'


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, checked, and what it asked of them."""

    functions: list[Function]
    choice: Function | str  # "none", "auto", "required", or the named function
    parser: str | None  # "auto": the server's parser
    param: str  # the client's field a constraint came from (for the engine's errors)

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        tools = []
        for function in self.functions:
            spec: dict[str, Any] = {"name": function.name, "parameters": function.parameters}
            if function.description is not None:
                spec["description"] = function.description
            tools.append({"type": "function", "function": spec})
        return tools

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for calls (not ``"none"``)."""
        return self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The output's constraint: a named function's parameters, or the
        array of calls of ``"required"``; None for ``"none"`` and ``"auto"``."""
        if isinstance(self.choice, Function):
            return JsonSchema(schema=self.choice.parameters)
        if self.choice == "required":
            return JsonSchema(schema=required_schema(self.functions))
        return None


def plan_tools(tools: Sequence[Any] | None, tool_choice: object, *, parser: str | None) -> ToolPlan | None:
    """The plan for a request's ``tools`` and ``tool_choice`` (None without
    tools). Raises ``InvalidRequestError`` naming the field at fault."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs 'tools' to choose from")
        return None
    if not all(isinstance(tool, Mapping) for tool in tools):
        at = next(i for i, tool in enumerate(tools) if not isinstance(tool, Mapping))
        raise InvalidRequestError(f"tools[{at}]", "must be an object: {'type': 'function', 'function': {...}}")
    functions = check_tools(tools)
    choice = chosen_function("auto" if tool_choice is None else tool_choice, functions)
    if choice == "auto" and parser is None:
        raise InvalidRequestError("tool_choice", AUTO_NEEDS)
    if isinstance(choice, Function):
        at = next(i for i, f in enumerate(functions) if f.name == choice.name)
        param = f"tools[{at}].function.parameters"
    else:
        param = "tools"
    return ToolPlan(functions, choice, parser if choice == "auto" else None, param)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with assistant ``tool_calls`` as chat templates take them:
    each call's ``arguments`` (a JSON text in OpenAI's API) as the object it
    holds, as templates write them with ``tojson``; a text that is not an
    object stays a text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        converted = []
        for call in calls:
            function = dict(call["function"])
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                function["arguments"] = arguments
            converted.append({**call, "function": function})
        out.append({**message, "tool_calls": converted})
    return out


# --- the output, read back -------------------------------------------------------


@dataclass
class CallPiece:
    """One chunk's part of a call (OpenAI's ``delta.tool_calls[i]``): the
    first piece of a call has its ``id`` and ``name``; a client joins the
    ``arguments`` of the pieces of one ``index``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def _whole(index: int, call: ToolCall) -> CallPiece:
    return CallPiece(index, call.arguments, call.with_id().id, call.name)


@dataclass
class ToolOutput:
    """One choice's output read for calls, as it streams or whole."""

    plan: ToolPlan
    _stream: ToolCallStream | None = None
    _text: str = ""
    _call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{secrets.token_hex(16)}")
    num_calls: int = 0

    def __post_init__(self) -> None:
        if self.plan.choice == "auto":
            assert self.plan.parser is not None
            self._stream = open_stream(self.plan.parser)

    def feed(self, text: str, *, last: bool) -> tuple[str, list[CallPiece]]:
        """The content and the call pieces of the next ``text`` of the
        output (``last``: its end has come)."""
        choice = self.plan.choice
        if isinstance(choice, Function):  # the output is the arguments: streamed as they come
            if not text and (self.num_calls or not last):
                return "", []
            first = self.num_calls == 0
            self.num_calls = 1
            return "", [CallPiece(0, text, self._call_id if first else None, choice.name if first else None)]
        if choice == "required":
            self._text += text
            if not last:
                return "", []
            made = forced_calls(choice, self._text)
            self.num_calls = len(made)
            return ("", [_whole(i, c) for i, c in enumerate(made)]) if made else (self._text, [])
        assert self._stream is not None
        pieces = self._stream.feed(text)
        if last:
            pieces += self._stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [_whole(p.index, p.call) for p in pieces if isinstance(p, CallDelta)]
        self.num_calls += len(calls)
        return content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when ``"auto"`` or ``"required"`` made
        calls and the output ended by itself (a named function's call ends
        with ``stop``, as OpenAI's does)."""
        if reason == "stop" and self.num_calls and not isinstance(self.plan.choice, Function):
            return "tool_calls"
        return reason


def read_whole(plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list[CallPiece], str | None]:
    """A whole output's content (None when it was only calls), its calls and finish reason."""
    output = ToolOutput(plan)
    content, calls = output.feed(text, last=True)
    if calls and plan.choice == "auto":
        content = content.strip()
    return (content or None) if calls else content, calls, output.finish_reason(reason)
