"""Where a JSON value does not fit a msgspec type, found from the type's structure."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import pytest

from trioserve.sampling_params import SamplingParams
from trioserve.server.misfit import Misfit, find_misfit, unknown_fields
from trioserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, decode_body


class A(msgspec.Struct, tag="a", forbid_unknown_fields=True):
    x: int


class B(msgspec.Struct, tag="b"):
    y: str


class Shapes(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    either: A | B | None = None
    table: dict[str, list[int]] = {}
    pick: Literal["up", "down"] = "up"
    size: float = 0.0
    pair: tuple[int, int] = (0, 0)


def invalid(path: str, message: str) -> Misfit:
    return Misfit(path, "invalid_type", message)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1], invalid("", "expected `object`, got `array`")),
        ({}, Misfit("name", "missing_field", "missing")),
        ({"name": 1}, invalid("name", "expected `str`, got `int`")),
        # Keys in the order they come: the unknown one before the missing one.
        ({"zz": 1}, Misfit("zz", "unknown_field", "unknown field")),
        ({"name": "n", "k" * 100: 1}, Misfit("k" * 64, "unknown_field", "unknown field")),
        ({"name": "n", "either": 5}, invalid("either", "expected `object | null`, got `int`")),
        ({"name": "n", "either": {"x": 1}}, Misfit("either.type", "missing_field", "missing")),
        ({"name": "n", "either": {"type": "c"}}, invalid("either.type", "invalid value 'c'")),
        ({"name": "n", "either": {"type": "a", "x": "1"}}, invalid("either.x", "expected `int`, got `str`")),
        ({"name": "n", "either": {"type": "a", "x": 1, "w": 0}}, Misfit("either.w", "unknown_field", "unknown field")),
        ({"name": "n", "either": {"type": "b"}}, Misfit("either.y", "missing_field", "missing")),
        ({"name": "n", "table": {"k": [1, "2"]}}, invalid("table[...][1]", "expected `int`, got `str`")),
        ({"name": "n", "table": []}, invalid("table", "expected `object`, got `array`")),
        ({"name": "n", "pick": "left"}, invalid("pick", "invalid enum value 'left'")),
        ({"name": "n", "pick": None}, invalid("pick", "expected `str`, got `null`")),
        ({"name": "n", "size": True}, invalid("size", "expected `float`, got `bool`")),
        ({"name": "n", "pair": [1]}, None),  # a tuple's length is not checked: the caller answers without a field
    ],
)
def test_the_first_misfit_is_named_with_its_path(value: object, expected: Misfit | None) -> None:
    with pytest.raises(msgspec.ValidationError):  # what msgspec refuses, the walk explains
        msgspec.convert(value, Shapes)
    assert find_misfit(value, Shapes) == expected


def test_a_value_msgspec_takes_has_no_misfit() -> None:
    value: dict[str, Any] = {"name": "n", "either": {"type": "b", "y": "z"}, "table": {"k": [1]}, "size": 2}
    msgspec.convert(value, Shapes)
    assert find_misfit(value, Shapes) is None
    assert find_misfit({"max_tokens": 3, "stop": ["a"], "seed": None}, SamplingParams) is None


@pytest.mark.parametrize(
    ("kind", "body", "param", "code"),
    [
        (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["a", 5]}, "stop[1]", "invalid_type"),
        (CompletionRequest, {"model": "m", "prompt": "x", "logit_bias": {"1": "x"}}, "logit_bias[...]", "invalid_type"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "bob"}]}, "messages[0].role", "invalid_type"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "missing_field"),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
            "invalid_type",
        ),
    ],
)
def test_a_request_body_that_does_not_fit_names_the_field(kind: Any, body: object, param: str, code: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_body(msgspec.json.encode(body), kind)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    assert info.value.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("body", "unknown"),
    [
        ({"model": "m", "prompt": "x", "stream_options": {"x": 1}}, ["stream_options.x"]),
        ({"model": "m", "prompt": "x", "metadata": {"a": 1}, "store": True}, ["metadata", "store"]),
        ({"model": "m", "prompt": [1, 2, 3] * 1000, "echo": False}, []),  # (a list of ints is not walked)
    ],
)
def test_unknown_fields_are_listed_ignored_or_refused_with_strict(body: object, unknown: list[str]) -> None:
    raw = msgspec.json.encode(body)
    assert unknown_fields(msgspec.json.decode(raw), CompletionRequest) == unknown
    assert isinstance(decode_body(raw, CompletionRequest), CompletionRequest)
    if unknown:
        with pytest.raises(OpenAIError) as info:
            decode_body(raw, CompletionRequest, strict=True)
        assert (info.value.status, info.value.param, info.value.code) == (400, unknown[0], "unknown_field")


def test_a_body_whose_misfit_the_walk_cannot_place_is_still_a_400_without_a_field() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_body(b'{"name": "n", "pair": [1]}', Shapes)
    assert (info.value.status, info.value.param, info.value.code) == (400, None, "invalid_type")
    assert info.value.message.startswith("the body does not fit the API: ")


def test_json_malformed_after_a_misfit_is_answered_as_malformed() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_body(b'{"model": 5, "prompt": "x"', CompletionRequest)
    assert info.value.code == "invalid_json" and info.value.message.startswith("malformed JSON: ")
