"""The public API is what docs/embedding.md says it is."""

from __future__ import annotations

import re
from pathlib import Path

import trioserve

DOCS = Path(__file__).parent.parent / "docs" / "embedding.md"


def test_public_names_are_the_documented_ones():
    text = DOCS.read_text()
    match = re.search(r"<!-- public-names -->(.*?)<!-- /public-names -->", text, re.S)
    assert match, "docs/embedding.md lists the public names between public-names markers"
    documented = set(re.findall(r"`([A-Za-z_]+)`", match.group(1)))
    assert documented == set(trioserve.__all__)
    for name in trioserve.__all__:
        assert getattr(trioserve, name) is not None
