"""The front-end's tokenizer: a Hugging Face ``tokenizer.json``, without torch.

Importing ``transformers`` imports torch, which costs seconds and memory the
front-end has no use for, so this module reads the model directory itself
and drives the ``tokenizers`` library directly:

- ``tokenizer.json`` (required): the model, normalizer, pre-tokenizer,
  post-processor and decoder, exactly as a fast tokenizer would use them.
  Truncation and padding saved in the file are switched off: a prompt is
  never cut or padded behind the caller's back.
- ``tokenizer_config.json`` (optional): the names of the BOS, EOS, PAD and
  UNK tokens. Its ``add_bos_token`` and ``add_eos_token`` are ignored, as
  transformers 5 ignores them when there is a tokenizer.json: the
  post-processor alone decides which special tokens a prompt gets, so that
  prompts are tokenized exactly as ``AutoTokenizer`` tokenizes them.
- ``generation_config.json`` and ``config.json`` (optional): ``eos_token_id``
  (an int or a list of ints), and ``bos_token_id`` when tokenizer_config.json
  does not say ``bos_token``.

Invariants: ``max_token_chars`` bounds the characters of text any one token
encodes (so a text of ``n`` characters has at least ``n / max_token_chars``
tokens, up to normalization); ``eos_token_ids`` has no duplicates and keeps that order of
preference (generation_config.json, config.json, tokenizer_config.json);
``all_special_ids`` holds BOS, every EOS, PAD, UNK and each token that
``decode(..., skip_special_tokens=True)`` skips.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from trioserve.byte_level import byte_of_char

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
GIL_FREE_ENCODE_CHARS = 4096  # longer texts are encoded with the GIL released (Tokenizer.encode)
_BYTE_OF_CHAR = byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token's vocabulary entry
_METASPACE = "\u2581"  # "▁"


class Tokenizer:
    """Text to token ids and back, for one model.

    Build it with ``Tokenizer.from_dir(model_dir)``. Its methods are
    synchronous and safe to call from several threads: nothing changes it
    once it is loaded.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        extra_special_ids: Iterable[int] = (),
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added_ids = set(added)  # kept as text, not as byte-level characters
        self._byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        # SentencePiece-style vocabularies write a space as "▁" (a Metaspace or Replace decoder says so).
        # The decoder's own JSON: a few bytes (the whole tokenizer's, with its vocabulary, took 0.1 s).
        decoder_spec = b"" if backend.decoder is None else backend.decoder.__getstate__()
        self._metaspace = _METASPACE.encode() in decoder_spec
        self.vocab_size: int = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        # The longest vocabulary entry, in characters: no token stands for more
        # text than this (byte-level entries spell each byte as one character).
        self.max_token_chars: int = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.all_special_ids: set[int] = {i for i, tok in added.items() if tok.special}
        # The text of each special token (what encode turns into its id where it appears in a text).
        self.special_texts: tuple[str, ...] = tuple(sorted({tok.content for tok in added.values() if tok.special}))
        self._literal: tokenizers.Tokenizer | None = None  # a copy that reads special tokens' text as text
        self._literal_lock = threading.Lock()
        self.all_special_ids.update(extra_special_ids)
        self.all_special_ids.update(self.eos_token_ids)
        if bos_token_id is not None:
            self.all_special_ids.add(bos_token_id)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Loads the tokenizer of the model in ``model_dir``.

        Raises ``FileNotFoundError`` naming the directory or ``tokenizer.json``
        when either is missing, and ``ValueError`` naming the file (and the
        field) when a file is not what it should be. Special tokens named in
        tokenizer_config.json that tokenizer.json does not know are ignored.
        """
        directory = Path(model_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"model directory not found: {str(directory)!r}")
        backend = _load_backend(directory / TOKENIZER_FILE)
        tok_path = directory / TOKENIZER_CONFIG_FILE
        tok_config = _read_json(tok_path)

        def token_id(field: str) -> int | None:
            name = _token_name(tok_config, field, tok_path)
            return None if name is None else backend.token_to_id(name)

        config_ids = _ConfigIds(directory)
        if "bos_token" in tok_config:  # even null: the tokenizer has no BOS
            bos_token_id = token_id("bos_token")
        else:
            bos_token_id = next(iter(config_ids("bos_token_id")), None)
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=[*config_ids("eos_token_id"), *_present([token_id("eos_token")])],
            extra_special_ids=_present([token_id("pad_token"), token_id("unk_token")]),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``, with the special tokens (such as BOS)
        that tokenizer.json's post-processor puts around a prompt unless
        ``add_special_tokens`` is False. Special tokens written in ``text``
        (``"<s>"``) become their ids. A long text is encoded with the GIL
        released (``encode_batch``: ``encode`` holds it throughout, so a
        worker thread tokenizing would stop the event loop's thread)."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_literal(self, text: str) -> list[int]:
        """The token ids of ``text`` with no special token in them: a
        special token's text (``"<|im_end|>"``) is encoded as the text it
        is, and nothing is added around it."""
        with self._literal_lock:  # one copy, made on first use (a copy: the setting is the tokenizer's own)
            if self._literal is None:
                literal = tokenizers.Tokenizer.from_str(self._backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
        backend = self._literal
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``. Ids the tokenizer does not know are skipped;
        bytes that are not valid UTF-8 (such as a character cut in half)
        decode as U+FFFD."""
        ids = ids if isinstance(ids, list) else list(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], *, skip_special_tokens: bool = True) -> TextStream:
        """A ``TextStream`` that decodes the ids stepped into it after
        ``context_ids`` (whose own text it never returns)."""
        return TextStream(self._backend, context_ids, skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (not its text), or ``None``."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, also when they are part of a
        character that other tokens finish (where ``decode`` gives U+FFFD):
        byte-level vocabularies (GPT-2's byte-to-character map) and byte
        fallback tokens (``<0xE2>``) are read as bytes, SentencePiece's
        ``▁`` as a space; any other token is the UTF-8 of its text."""
        entry = self._backend.id_to_token(token_id)
        if entry is None:
            return b""
        if self._byte_level and token_id not in self._added_ids and all(c in _BYTE_OF_CHAR for c in entry):
            return bytes(_BYTE_OF_CHAR[c] for c in entry)
        if match := _BYTE_FALLBACK.fullmatch(entry):
            return bytes([int(match[1], 16)])
        if self._metaspace and token_id not in self._added_ids:
            return entry.replace(_METASPACE, " ").encode()  # decode() would strip a first token's space
        return self.decode([token_id], skip_special_tokens=False).encode()

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids})"
        )


class TextStream:
    """One request's text, decoded a token at a time by the ``tokenizers``
    library's ``DecodeStream`` (native code: about a quarter of the time of
    decoding a window of ids from Python each step).

    ``step`` returns the text a token settles, or ``None`` while there is
    none: a skipped special token, or a character that later tokens finish
    (the text would end in U+FFFD). Held tokens come out with the token that
    settles them. Raises ``TextStreamError`` when the decoder's text for the
    window no longer begins with the text already returned (a decoder that
    rewrites earlier text); the stream is then spent.
    """

    def __init__(self, backend: tokenizers.Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = tokenizers.decoders.DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:  # the Rust side raises plain Exception
            raise TextStreamError(str(exc)) from exc


class TextStreamError(Exception):
    """A ``TextStream`` could not extend its text (see ``TextStream``)."""


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(
            f"{TOKENIZER_FILE} not found in {str(path.parent)!r}: trioserve needs the "
            "fast-tokenizer file (a directory with only a SentencePiece "
            "tokenizer.model can be converted by saving it once with transformers)"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ValueError(f"{path}: not a valid tokenizer file: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    """The object in an optional JSON file; ``{}`` when there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


class _ConfigIds:
    """Token ids named in generation_config.json, then in config.json."""

    def __init__(self, directory: Path) -> None:
        paths = [directory / GENERATION_CONFIG_FILE, directory / MODEL_CONFIG_FILE]
        self._configs = [(path, _read_json(path)) for path in paths]

    def __call__(self, field: str) -> list[int]:
        """``field`` (an int or a list of ints) from each file that has it."""
        ids: list[int] = []
        for path, config in self._configs:
            value = config.get(field)
            values = [] if value is None else value if isinstance(value, list) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"{path}: {field} must be a non-negative int or a list of them (got {value!r})")
            ids.extend(values)
        return ids


def _token_name(config: dict[str, Any], field: str, path: Path) -> str | None:
    """A special token's text from tokenizer_config.json: a string, or an
    AddedToken saved as ``{"content": ...}``."""
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{path}: {field} must be a string (got {value!r})")


def _present(ids: Iterable[int | None]) -> list[int]:
    return [i for i in ids if i is not None]
