"""The public API is what docs/embedding.md says it is."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import trioserve

DOCS = Path(__file__).parent.parent / "docs" / "embedding.md"


def documented_names() -> set[str]:
    text = DOCS.read_text()
    match = re.search(r"<!-- public-names -->(.*?)<!-- /public-names -->", text, re.S)
    assert match, "docs/embedding.md lists the public names between public-names markers"
    return set(re.findall(r"`([A-Za-z_]+)`", match.group(1)))


def test_public_names_are_the_documented_ones():
    assert documented_names() == set(trioserve.__all__)


def test_every_public_name_is_a_class_or_function_of_trioserve():
    for name in trioserve.__all__:
        obj = getattr(trioserve, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("trioserve."), (name, obj.__module__)
        assert obj.__name__ == name, name


def test_the_errors_share_one_base_or_are_value_errors():
    for name in trioserve.__all__:
        obj = getattr(trioserve, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, (trioserve.TrioserveError, ValueError)), name
