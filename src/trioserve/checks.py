"""Checks of a request's values, each raising ``InvalidRequestError`` naming
the field: the building blocks of ``SamplingParams.__post_init__``
(``messages.py``), kept here so that the message types stay short.

Every value is checked for its exact type (an ``int``, ``float`` or ``str``
of exactly that type: msgpack cannot encode a subclass) and its range; the
sizes of lists and dicts are bounded, so that a request's cost in the
engine and in each step stays small whatever a client sends.
"""

from __future__ import annotations

import reprlib

from trioserve.errors import InvalidRequestError

MAX_INT32 = 2**31 - 1

_REPR = reprlib.Repr()  # bounded nesting and lengths: cheap whatever the value
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 60


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message.
    Never raises: a value nested too deeply, an int too long to print, or a
    broken ``__repr__`` is described by its type."""
    try:
        text = _REPR.repr(value)
    except Exception:  # RecursionError, ValueError (int to str), whatever __repr__ raises
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        text = f"<{type(value).__name__}{size}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_plain_int(value: object) -> bool:
    """An ``int``: not a bool, nor another subclass (which msgpack cannot encode)."""
    return type(value) is int


def is_valid_text(text: str) -> bool:
    """True when ``text`` can be encoded as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad(name: str, message: str, value: object) -> InvalidRequestError:
    """The error for field ``name``: ``message``, and the value it got."""
    kind = "" if type(value).__module__ == "builtins" else f" of type {type(value).__name__}"
    return InvalidRequestError(name, f"{message} (got {short_repr(value)}{kind})")


def check_int(name: str, value: object, low: int, high: int, note: str = "") -> None:
    if not is_plain_int(value) or not low <= value <= high:  # type: ignore[operator]
        extra = f"; {note}" if note else ""
        raise bad(name, f"must be an integer in [{low}, {high}]{extra}", value)


def check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    ok = type(value) in (int, float) and (low < value <= high if low_open else low <= value <= high)  # type: ignore[operator]
    if not ok:  # NaN fails every comparison
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise bad(name, f"must be a number in {interval}", value)


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise bad(name, "must be true or false", value)


def check_strings(name: str, value: object, *, max_count: int, max_chars: int, what: str) -> None:
    """A list of at most ``max_count`` non-empty strings of ``max_chars``
    characters in all (``what``: what one is called in the messages)."""
    if not isinstance(value, list) or not all(type(s) is str and s for s in value):
        raise bad(name, "must be a list of non-empty strings", value)
    if len(value) > max_count:
        raise bad(name, f"at most {max_count} {what}s", f"{len(value)} {what}s")
    total = sum(len(s) for s in value)
    if total > max_chars:
        raise bad(name, f"at most {max_chars} characters in all", f"{total} characters")
    for s in value:
        if not is_valid_text(s):
            raise bad(name, "invalid string: it holds a lone UTF-16 surrogate", s)


def check_token_ids(name: str, value: object, *, max_count: int, allow_empty: bool = True) -> None:
    """A list of at most ``max_count`` token ids in [0, ``MAX_INT32``] (the
    vocabulary is checked where it is known: ``frontend/text/sampling.py``)."""
    if not isinstance(value, list) or not all(is_plain_int(t) and 0 <= t <= MAX_INT32 for t in value):
        raise bad(name, f"must be a list of token ids in [0, {MAX_INT32}]", value)
    if len(value) > max_count:
        raise bad(name, f"at most {max_count} ids", f"{len(value)} ids")
    if not allow_empty and not value:
        raise bad(name, "must not be empty", value)


def check_logit_bias(name: str, value: object, *, max_entries: int, max_abs: float) -> None:
    """A dict of at most ``max_entries`` token ids to biases in
    [-``max_abs``, ``max_abs``]."""
    if not isinstance(value, dict):
        raise bad(name, "must be a map of token ids to biases", value)
    if len(value) > max_entries:
        raise bad(name, f"at most {max_entries} entries", f"{len(value)} entries")
    for token_id, bias in value.items():
        if not is_plain_int(token_id) or not 0 <= token_id <= MAX_INT32:
            raise bad(name, f"keys must be token ids in [0, {MAX_INT32}]", token_id)
        if type(bias) not in (int, float) or not -max_abs <= bias <= max_abs:
            raise bad(name, f"biases must be numbers in [{-max_abs:g}, {max_abs:g}]", bias)


def check_token_sequences(name: str, value: object, *, max_count: int, max_length: int) -> None:
    """A list of at most ``max_count`` non-empty lists of at most
    ``max_length`` token ids each."""
    if not isinstance(value, list) or len(value) > max_count:
        raise bad(name, f"must be a list of at most {max_count} token-id lists", value)
    for ids in value:
        if not isinstance(ids, list) or not 0 < len(ids) <= max_length:
            raise bad(name, f"each must be a list of 1 to {max_length} token ids", ids)
        check_token_ids(name, ids, max_count=max_length)
