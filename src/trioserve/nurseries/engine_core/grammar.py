"""Constraints as llguidance grammars: the text of each, its check, its
matcher, and the token bitmask rows (plain synchronous calls; the caller
decides which thread runs them).

llguidance was chosen over xgrammar by measuring both on the schema suite
(README, "Structured outputs"): it compiles a schema in about a millisecond
rather than tens, fills a batch's masks as fast, and imports no torch, so
the engine core stays torch-free. llguidance and numpy are imported by the
functions that need them, on the first constrained request: most engines
never see one, and every engine core (and API server) would otherwise pay
their import (about 80 ms, 40% of an engine core's start-up).

JSON is held to one layout: no whitespace but ``", "`` between items and
``": "`` after keys (a schema's own ``x-guidance`` options may say
otherwise); free whitespace would let a model pad its output forever.
Keywords the engine cannot enforce (``uniqueItems``...) are refused, never
ignored: an output that passes is one the schema accepts.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from trioserve.structured import Choice, Grammar, JsonObject, JsonSchema, Regex, StructuredOutput

if TYPE_CHECKING:
    import llguidance

JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.cache
def limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits: its defaults, but a smaller grammar (symbols in
    all productions) and no parser state in error messages (they reach clients)."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=200_000, verbose_errors=False)


class ConstraintError(ValueError):
    """A constraint llguidance refuses: its message says why."""


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar for ``constraint``. Raises ``ConstraintError``
    if it cannot be written as one (a GBNF grammar that does not parse, a
    schema that is not a JSON object)."""
    import llguidance
    import llguidance.gbnf_to_lark

    try:
        match constraint:
            case JsonSchema(schema=schema):
                return str(llguidance.LLMatcher.grammar_from_json_schema(_schema(schema), defaults=JSON_OPTIONS))
            case JsonObject():
                return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
            case Regex(pattern=pattern):
                return str(llguidance.LLMatcher.grammar_from_regex(pattern))
            case Choice(choices=choices):
                return str(llguidance.LLMatcher.grammar_from_regex("|".join(map(_literal, choices))))
            case Grammar(grammar=grammar):
                return str(llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(grammar)))
    except ConstraintError:
        raise
    except Exception as exc:  # llguidance's own errors are ValueError, GbnfToLarkError...
        raise ConstraintError(_message(str(exc), type(exc).__name__)) from exc
    raise ConstraintError(f"unknown constraint {type(constraint).__name__}")


def _schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    # ``true`` accepts any JSON value; ``false`` none (refused as the empty type list).
    if schema is True:
        return {}
    if schema is False:
        raise ConstraintError("the schema false accepts nothing")
    return schema


def _literal(text: str) -> str:
    """``text`` as a regex that matches it alone: letters and digits as they
    are, every other character by its code point."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


MAX_ERROR_CHARS = 400  # of a grammar engine's message, in an error a client reads


def _message(text: str, fallback: str) -> str:
    """llguidance's (multi-line) message on one line, cut to ``MAX_ERROR_CHARS``."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip()) or fallback
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def check(constraint: StructuredOutput) -> None:
    """Raise ``ConstraintError`` saying what is wrong if ``constraint`` cannot
    compile (any tokenizer; about a millisecond for the schema suite)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint), limits=limits())
    if error:
        raise ConstraintError(_message(error, "invalid"))


class Tokenizer:
    """The model's tokenizer as llguidance needs it, built once on first use
    (about half a second for a 50k vocabulary), from any thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._path = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._lock = threading.Lock()
        self._built: llguidance.LLTokenizer | None = None

    def get(self) -> llguidance.LLTokenizer:
        """The tokenizer. Raises ``ConstraintError`` if the model has none that llguidance reads."""
        with self._lock:
            if self._built is None:
                import llguidance

                try:
                    with open(self._path, encoding="utf-8") as f:
                        text = f.read()
                    eos = self._eos or None
                    self._built = llguidance.LLTokenizer(text, n_vocab=self._vocab_size, eos_token=eos)
                except Exception as exc:
                    raise ConstraintError(
                        f"structured outputs need the model's tokenizer ({_message(str(exc), type(exc).__name__)})"
                    ) from exc
            return self._built


def compile_matcher(tokenizer: Tokenizer, constraint: StructuredOutput) -> llguidance.LLMatcher:
    """A fresh matcher for ``constraint`` (the template each request's
    matcher is copied from), with its first mask computed so that lexer
    states it needs are built here, not in a step. Raises ``ConstraintError``."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer.get(), grammar_text(constraint), log_level=0, limits=limits())
    if matcher.is_error():
        raise ConstraintError(_message(matcher.get_error(), "invalid"))
    matcher.deep_copy().compute_bitmask()
    return matcher


class GrammarMatcher:
    """One request's matcher: what the scheduler sees as its constraint."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def is_complete(self) -> bool:
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()


class BitmaskFiller:
    """Fills the bitmask rows of a step on llguidance's own thread pool (the
    GIL is released meanwhile)."""

    def __init__(self, vocab_size: int, num_threads: int) -> None:
        import llguidance

        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    def fill(self, matchers: list[GrammarMatcher]) -> bytes:
        """One row per matcher, as little-endian int32 words."""
        import llguidance.numpy
        import numpy as np

        rows = np.full((len(matchers), self.words), -1, dtype="<i4")
        if matchers:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(m.matcher, i) for i, m in enumerate(matchers)], rows
            )
        return rows.tobytes()
