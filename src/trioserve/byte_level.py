"""Byte-level vocabularies (GPT-2's, and those of most models since) spell
each byte as one printable character: a printable Latin-1 byte as itself,
every other byte as the character 256 + its rank among those. The front-end
reads tokens back into bytes with it (``frontend/text/tokenizer.py``); the tiny
test models build their vocabulary with it (``gpu/tiny_models.py``)."""

from __future__ import annotations

_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def char_of_byte() -> dict[int, str]:
    """Each byte's character."""
    others = [b for b in range(256) if b not in _PRINTABLE]
    return {b: chr(b) for b in _PRINTABLE} | {b: chr(256 + rank) for rank, b in enumerate(others)}


def byte_of_char() -> dict[str, int]:
    """Each character's byte."""
    return {char: b for b, char in char_of_byte().items()}
