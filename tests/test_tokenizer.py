"""Tests for trioserve.frontend.text.tokenizer, on the tokenizer.json files
that ``helpers.tokenizers`` builds (a byte-level BPE and a Llama-style one)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.tokenizers import (
    BOS,
    BYTE_MERGES,
    EOS,
    PAD,
    SPECIALS,
    build_byte_level,
    write_byte_level_model,
    write_llama_style_model,
    write_model_dir,
)

from trioserve.frontend.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_level_model(tmp_path_factory.mktemp("byte")))


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_llama_style_model(tmp_path_factory.mktemp("llama")))


# --- loading ---------------------------------------------------------------


def test_from_dir_reads_special_token_ids(byte_tok: Tokenizer) -> None:
    assert byte_tok.vocab_size == 256 + len(BYTE_MERGES) + len(SPECIALS)
    assert byte_tok.bos_token_id == BOS
    assert byte_tok.eos_token_ids == [EOS]
    assert byte_tok.all_special_ids == {PAD, BOS, EOS}


def test_eos_ids_merge_generation_config_then_config_then_tokenizer_config(
    tmp_path: Path,
) -> None:
    backend = build_byte_level()
    eos = backend.token_to_id("</s>")
    write_model_dir(
        tmp_path,
        backend,
        tokenizer_config={"eos_token": "</s>"},
        generation_config={"eos_token_id": [7, eos]},
        config={"eos_token_id": 9},
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == [7, eos, 9]
    assert {7, 9, eos} <= tok.all_special_ids


def test_bos_comes_from_config_files_unless_tokenizer_config_names_it(
    tmp_path: Path,
) -> None:
    backend = build_byte_level()
    bos = backend.token_to_id("<s>")
    write_model_dir(tmp_path, backend, tokenizer_config={}, config={"bos_token_id": bos})
    assert Tokenizer.from_dir(tmp_path).bos_token_id == bos
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": null}')
    assert Tokenizer.from_dir(tmp_path).bos_token_id is None


def test_without_config_files_only_tokenizer_json_is_needed(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, build_byte_level()))
    assert tok.eos_token_ids == []
    assert tok.bos_token_id is None
    assert tok.decode(tok.encode("hello")) == "hello"


def test_special_tokens_saved_as_added_token_dicts(llama_tok: Tokenizer) -> None:
    assert llama_tok.bos_token_id == 1
    assert llama_tok.eos_token_ids == [2]
    assert {0, 1, 2} <= llama_tok.all_special_ids


def test_missing_model_dir_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer file"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("generation_config.json", "{not json", r"generation_config.json: not valid JSON"),
        ("config.json", "[1, 2]", r"config.json: expected a JSON object"),
        ("config.json", '{"eos_token_id": "2"}', r"config.json: eos_token_id must be"),
        ("generation_config.json", '{"eos_token_id": [1, -2]}', r"eos_token_id must be"),
        ("tokenizer_config.json", '{"eos_token": 5}', r"tokenizer_config.json: eos_token"),
    ],
)
def test_bad_config_file_names_file_and_field(tmp_path: Path, name: str, content: str, message: str) -> None:
    write_model_dir(tmp_path, build_byte_level())
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_dir(tmp_path)


# --- encode and decode -----------------------------------------------------


def test_encode_prepends_bos_from_post_processor(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("hello")
    assert ids[0] == byte_tok.bos_token_id
    assert ids[1:] == [256 + 1, ord("l"), ord("o")]  # "hel" is a merge


@pytest.mark.parametrize("text", ["hello world", "naïve café", "🙂 東京", ""])
def test_decode_of_encode_round_trips(byte_tok: Tokenizer, llama_tok: Tokenizer, text: str) -> None:
    for tok in (byte_tok, llama_tok):
        assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens_unless_asked(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("hi") + byte_tok.eos_token_ids
    assert byte_tok.decode(ids) == "hi"
    assert byte_tok.decode(ids, skip_special_tokens=False) == "<s>hi</s>"


def test_decode_of_half_a_character_is_replacement_char(byte_tok: Tokenizer) -> None:
    assert byte_tok.decode([0xC3]) == "\ufffd"
    assert byte_tok.decode([0xC3, 0xA9]) == "é"


def test_llama_style_falls_back_to_bytes_for_unknown_characters(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("🙂")
    tokens = [llama_tok.id_to_token(i) for i in ids]
    assert tokens[0] == "<s>"
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


@pytest.mark.parametrize("add_bos_token", [True, False])
@pytest.mark.parametrize("post_processor", [True, False])
def test_post_processor_alone_decides_bos_as_in_transformers_5(
    tmp_path: Path, add_bos_token: bool, post_processor: bool
) -> None:
    backend = build_byte_level()
    if not post_processor:
        backend.post_processor = None
    config = {"bos_token": "<s>", "add_bos_token": add_bos_token}
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, backend, tokenizer_config=config))
    assert tok.encode("hi") == [BOS] * post_processor + [ord("h"), ord("i")]


def test_truncation_and_padding_saved_in_the_file_are_ignored(tmp_path: Path) -> None:
    backend = build_byte_level()
    backend.enable_truncation(max_length=3)
    backend.enable_padding(length=32, pad_id=backend.token_to_id("<pad>"))
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, backend))
    assert tok.decode(tok.encode("a longer prompt")) == "a longer prompt"


@pytest.mark.parametrize("write", [write_byte_level_model, write_llama_style_model])
def test_same_ids_and_text_as_transformers_auto_tokenizer(tmp_path: Path, write: Callable[[Path], Path]) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = write(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.vocab_size == len(reference)
    assert tok.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in tok.eos_token_ids
    assert tok.all_special_ids == set(reference.all_special_ids)
    for text in ["hello world", "", "naïve café 🙂 東京", " two  spaces\n", "<s>x</s>"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_importing_tokenizer_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, trioserve.frontend.text.tokenizer, trioserve.frontend.text.detokenizer; "
        "bad = {'torch', 'transformers'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_token_bytes_are_each_tokens_own_bytes_however_a_character_is_cut(
    byte_tok: Tokenizer, llama_tok: Tokenizer
) -> None:
    for tok in (byte_tok, llama_tok):  # byte-level, and SentencePiece-style byte fallback (<0xF0>)
        ids = tok.encode("lo 🎉 ok", add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces).decode().strip() == "lo 🎉 ok"
        assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a lone byte of the emoji
    assert byte_tok.token_bytes(EOS) == b"</s>"  # an added token: its text
