"""Structured outputs as the OpenAI-compatible API asks for them: OpenAI's
``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's
extra parameters (``structured_outputs`` with ``json``, ``regex``,
``choice``, ``grammar`` or ``json_object``, and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``), turned into the
one constraint a request may carry. No I/O."""

from __future__ import annotations

from typing import Any

import msgspec

from trioserve.structured import Choice, Grammar, JsonObject, JsonSchema, Regex, StructuredOutput


class JsonSchemaFormat(msgspec.Struct):
    """``response_format.json_schema``: ``schema`` is what counts (absent: any JSON)."""

    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON
    text), ``regex``, ``choice``, ``grammar``, ``json_object``."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Accepted: JSON here never has free whitespace, and there is no other engine to fall back to.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None


class StructuredFields(msgspec.Struct, kw_only=True):
    """The request fields that may ask for a constraint (both endpoints)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, unused: there is one engine


class StructuredError(ValueError):
    """A constraint asked for wrongly: ``param`` names the client's field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def requested_constraint(fields: StructuredFields) -> tuple[StructuredOutput | None, str]:
    """The one constraint the request asks for (None: none), and the
    client's name for where it came from. Raises ``StructuredError`` when
    more than one is given, or one is malformed."""
    found: list[tuple[str, StructuredOutput]] = []
    if fields.response_format is not None:
        found += _response_format(fields.response_format)
    if fields.structured_outputs is not None:
        found += _structured_outputs(fields.structured_outputs)
    found += _named("guided_", fields.guided_json, fields.guided_regex, fields.guided_choice, fields.guided_grammar)
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise StructuredError(found[1][0], f"one structured-output constraint per request (got {names})")
    if not found:
        return None, "response_format"
    name, constraint = found[0]
    return constraint, name


def _named(
    prefix: str,
    json_value: dict[str, Any] | bool | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[tuple[str, StructuredOutput]]:
    """The constraints given under vLLM's names: ``{prefix}json``, ``{prefix}regex``, ``{prefix}choice``,
    ``{prefix}grammar`` (``guided_json``..., ``structured_outputs.json``...)."""
    found: list[tuple[str, StructuredOutput]] = []
    if json_value is not None:
        found.append((f"{prefix}json", _json_schema(f"{prefix}json", json_value)))
    if regex is not None:
        found.append((f"{prefix}regex", Regex(pattern=regex)))
    if choice is not None:
        found.append((f"{prefix}choice", Choice(choices=choice)))
    if grammar is not None:
        found.append((f"{prefix}grammar", Grammar(grammar=grammar)))
    return found


def _response_format(fmt: ResponseFormat) -> list[tuple[str, StructuredOutput]]:
    if fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", JsonObject())]
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise StructuredError("response_format.json_schema", 'required with "type": "json_schema"')
        schema = fmt.json_schema.schema
        return [("response_format.json_schema.schema", JsonSchema(schema=True if schema is None else schema))]
    raise StructuredError("response_format.type", f'must be "text", "json_object" or "json_schema" (got {fmt.type!r})')


def _structured_outputs(params: StructuredOutputsParams) -> list[tuple[str, StructuredOutput]]:
    found = _named("structured_outputs.", params.json, params.regex, params.choice, params.grammar)
    if params.json_object:
        found.append(("structured_outputs.json_object", JsonObject()))
    if not found:
        raise StructuredError("structured_outputs", "give one of json, regex, choice, grammar or json_object")
    return found


def _json_schema(param: str, schema: dict[str, Any] | bool | str) -> JsonSchema:
    if isinstance(schema, str):  # the schema's JSON text
        try:
            schema = msgspec.json.decode(schema)
        except (msgspec.DecodeError, RecursionError):
            raise StructuredError(param, "a string here must hold a JSON schema (it is not JSON)") from None
        if not isinstance(schema, dict | bool):
            raise StructuredError(param, "must be a JSON schema: an object, or true")
    return JsonSchema(schema=schema)
