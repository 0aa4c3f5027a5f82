"""The JSON-schema suite of the structured-output tests and measurements:
nested objects, arrays with bounds, enums, integers with bounds, ``anyOf``,
``$ref``/``$defs``, string patterns and formats, optional fields.

Each entry is ``(name, schema, example)``: ``example`` is an instance the
schema accepts (``scripts/grammar_engines.py`` walks a matcher through its
tokens to time the per-step masks). Free strings carry a ``maxLength``, and
numbers bounds, so that a random model's output ends within a few hundred
tokens: a tiny random model picks the closing quote of an unbounded string,
or the end of an unbounded number, rarely.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}  # digits bounded, as free strings are

SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    (
        "flat_object",
        {
            "type": "object",
            "properties": {"name": NAME, "age": INT, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
            "additionalProperties": False,
        },
        {"name": "Ada", "age": 36, "ok": True},
    ),
    (
        "nested_object",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 1000},
                        "address": {
                            "type": "object",
                            "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                            "required": ["city", "zip"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["id", "address"],
                    "additionalProperties": False,
                }
            },
            "required": ["user"],
            "additionalProperties": False,
        },
        {"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}},
    ),
    (
        "bounded_array",
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
        [1, -2, 3],
    ),
    (
        "enum",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]}},
            "required": ["color", "size"],
            "additionalProperties": False,
        },
        {"color": "green", "size": None},
    ),
    (
        "integer_bounds",
        {"type": "integer", "minimum": 10, "maximum": 99},
        42,
    ),
    (
        "number_bounds",
        {
            "type": "object",
            # multipleOf bounds the digits too (a random model may never end a free fraction)
            "properties": {"t": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25}},
            "required": ["t"],
            "additionalProperties": False,
        },
        {"t": 0.25},
    ),
    (
        "any_of",
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 9},
                {
                    "type": "object",
                    "properties": {"kind": {"const": "text"}, "text": NAME},
                    "required": ["kind", "text"],
                    "additionalProperties": False,
                },
            ]
        },
        {"kind": "text", "text": "hi"},
    ),
    (
        "refs_and_defs",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": INT, "y": INT},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
            "additionalProperties": False,
        },
        {"start": {"x": 0, "y": 1}, "end": {"x": 2, "y": 3}},
    ),
    (
        "recursive_ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}]},
    ),
    (
        "string_pattern",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["code", "hex"],
            "additionalProperties": False,
        },
        {"code": "ABC-123", "hex": "#00ff7a"},
    ),
    (
        "string_formats",
        {
            "type": "object",
            "properties": {
                "day": {"type": "string", "format": "date"},
                "id": {"type": "string", "format": "uuid"},
                "ip": {"type": "string", "format": "ipv4"},
            },
            "required": ["day", "id", "ip"],
            "additionalProperties": False,
        },
        {"day": "2024-02-29", "id": "123e4567-e89b-12d3-a456-426614174000", "ip": "10.0.0.1"},
    ),
    (
        "optional_fields",
        {
            "type": "object",
            "properties": {"a": INT, "b": NAME, "c": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        {"a": 1, "c": False},
    ),
    (
        "array_of_objects",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}, "qty": INT},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        [{"sku": "ab12", "qty": 3}],
    ),
    (
        "string_length",
        {
            "type": "object",
            "properties": {"short": {"type": "string", "minLength": 2, "maxLength": 5}},
            "required": ["short"],
            "additionalProperties": False,
        },
        {"short": "abc"},
    ),
    (
        "nullable_union",
        {
            "type": "object",
            "properties": {
                "maybe": {"type": ["integer", "null"], "maximum": 99, "minimum": 0},
                "tags": {"type": "array", "items": NAME, "maxItems": 3},
            },
            "required": ["maybe", "tags"],
            "additionalProperties": False,
        },
        {"maybe": None, "tags": ["x", "y"]},
    ),
    (
        "one_of_consts",
        {"oneOf": [{"const": "yes"}, {"const": "no"}, {"const": 0}]},
        "no",
    ),
    (
        "tool_call",
        {
            "type": "object",
            "properties": {
                "name": {"enum": ["get_weather", "get_time"]},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": NAME,
                        "unit": {"enum": ["c", "f"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
    ),
]
