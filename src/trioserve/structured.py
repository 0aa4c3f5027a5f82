"""Structured outputs: the one constraint a request's output may be held to.

A constraint is one of five msgspec Structs, a tagged union on ``type``:
``JsonSchema`` (a JSON Schema), ``JsonObject`` (any JSON object),
``Regex``, ``Choice`` (exactly one of some strings) and ``Grammar`` (a Lark
grammar in llguidance's dialect, or GBNF). It travels inside
``SamplingParams.structured``; the engine core compiles it
(``nurseries/engine_core/grammar.py``) and holds the sampled tokens to it.

Bounds, so that a constraint costs little whatever a client sends:
``MAX_CONSTRAINT_BYTES`` of JSON for the whole constraint, nesting at most
``MAX_SCHEMA_DEPTH`` objects and arrays deep, at most ``MAX_CHOICES``
choices. ``check_constraint`` says what breaks them; it checks shape and
size only (whether a schema or grammar compiles is for the grammar engine).
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_CONSTRAINT_BYTES = 64 * 1024  # the constraint, encoded as JSON
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a JSON schema
MAX_CHOICES = 1024  # strings in a Choice


class JsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", frozen=True):
    """Output that validates against ``schema`` (a JSON Schema: an object, or ``true``)."""

    schema: dict[str, Any] | bool


class JsonObject(msgspec.Struct, tag="json_object", tag_field="type", frozen=True):
    """Output that is one JSON object (OpenAI's ``{"type": "json_object"}``)."""


class Regex(msgspec.Struct, tag="regex", tag_field="type", frozen=True):
    """Output that matches ``pattern`` entirely (no anchors needed)."""

    pattern: str


class Choice(msgspec.Struct, tag="choice", tag_field="type", frozen=True):
    """Output that is exactly one of ``choices``."""

    choices: list[str]


class Grammar(msgspec.Struct, tag="grammar", tag_field="type", frozen=True):
    """Output that the grammar's start rule derives: Lark syntax (as llguidance
    reads it), or GBNF (llama.cpp's, told apart by its ``::=``)."""

    grammar: str


StructuredOutput = JsonSchema | JsonObject | Regex | Choice | Grammar
CONSTRAINT_TYPES = (JsonSchema, JsonObject, Regex, Choice, Grammar)

_encode = msgspec.json.Encoder(order="sorted").encode


def constraint_key(constraint: StructuredOutput) -> bytes:
    """The same bytes for equal constraints (dict keys sorted): what compiled
    grammars are cached by."""
    return _encode(constraint)


def check_constraint(constraint: object) -> str | None:
    """What is wrong with ``constraint``'s shape or size, or None."""
    if not isinstance(constraint, CONSTRAINT_TYPES):
        return f"must be one of {', '.join(t.__name__ for t in CONSTRAINT_TYPES)} (got {type(constraint).__name__})"
    if isinstance(constraint, JsonSchema) and nesting_depth(constraint.schema) > MAX_SCHEMA_DEPTH:
        return f"schema nests more than {MAX_SCHEMA_DEPTH} levels deep"  # checked before encoding it
    try:
        size = len(_encode(constraint))
    except (TypeError, ValueError, RecursionError) as exc:
        return f"cannot be encoded as JSON ({type(exc).__name__})"
    if size > MAX_CONSTRAINT_BYTES:
        return f"is {size} bytes of JSON; at most {MAX_CONSTRAINT_BYTES}"
    match constraint:
        case JsonSchema(schema=schema):
            if not isinstance(schema, dict | bool):
                return "schema must be a JSON object or true/false"
        case Regex(pattern=pattern):
            if not isinstance(pattern, str) or not pattern:
                return "pattern must be a non-empty string"
        case Choice(choices=choices):
            if not isinstance(choices, list) or not choices or not all(type(c) is str and c for c in choices):
                return "choices must be a non-empty list of non-empty strings"
            if len(choices) > MAX_CHOICES:
                return f"{len(choices)} choices; at most {MAX_CHOICES}"
        case Grammar(grammar=grammar):
            if not isinstance(grammar, str) or not grammar.strip():
                return "grammar must be a non-empty string"
    return None


def nesting_depth(value: object) -> int:
    """How deeply dicts and lists nest in ``value`` (a scalar is 0), without
    recursion; past ``MAX_SCHEMA_DEPTH`` the walk stops at the first level beyond."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest  # deep enough to refuse: no need to walk the rest
        stack.extend((child, depth + 1) for child in children)
    return deepest
