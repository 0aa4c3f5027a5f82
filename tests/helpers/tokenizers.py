"""Tokenizers built here, saved as model directories (``tokenizer.json`` and
the config files that name special tokens), for the tests of the tokenizer
and the detokenizer. Two styles:

- a GPT-2-style byte-level BPE: the 256 byte tokens (token id == byte value),
  a few merges, some of which cut a UTF-8 character in two, and a
  post-processor that prepends ``<s>``;
- a Llama-style SentencePiece BPE: merges trained on a small text, ``▁`` for
  spaces, ``<0xNN>`` byte-fallback tokens, and a decoder that strips the
  leading space.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<pad>", "<s>", "</s>"]
# Merges of the byte-level tokenizer, as byte strings. " \xc3" is a space and
# the first byte of "é"; "\xa9l" the second byte of "é" and an "l"; "\xf0\x9f"
# and "\xe6\x9d" the first bytes of an emoji and of "東".
BYTE_MERGES = [
    (b"h", b"e"),
    (b"he", b"l"),
    (b" ", b"t"),
    (b" ", b"\xc3"),
    (b"\xa9", b"l"),
    (b"\xf0", b"\x9f"),
    (b"\xe6", b"\x9d"),
]
PAD, BOS, EOS = (256 + len(BYTE_MERGES) + i for i in range(len(SPECIALS)))
LLAMA_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. do not panic; it is only a test!",
    "a cafe on the corner sells tea and cake",
]


def byte_to_char() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters that stand for them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return chars


def build_byte_level() -> tokenizers.Tokenizer:
    to_char = byte_to_char()

    def token(data: bytes) -> str:
        return "".join(to_char[b] for b in data)

    vocab = {to_char[b]: b for b in range(256)}
    merges = [(token(a), token(b)) for a, b in BYTE_MERGES]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def build_llama_style() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(LLAMA_CORPUS * 10, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback for every character not in the vocab
        vocab[f"<0x{b:02X}>"] = len(vocab)
    spec["model"].update(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def write_model_dir(
    directory: Path,
    backend: tokenizers.Tokenizer,
    *,
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
    config: dict | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    for name, value in [
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
        ("config.json", config),
    ]:
        if value is not None:
            (directory / name).write_text(json.dumps(value))
    return directory


def write_byte_level_model(directory: Path) -> Path:
    backend = build_byte_level()
    return write_model_dir(
        directory,
        backend,
        tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        generation_config={"eos_token_id": backend.token_to_id("</s>")},
    )


def write_llama_style_model(directory: Path) -> Path:
    backend = build_llama_style()
    return write_model_dir(
        directory,
        backend,
        tokenizer_config={
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
            "unk_token": "<unk>",
        },
        config={"eos_token_id": backend.token_to_id("</s>"), "bos_token_id": 1},
    )
