"""Tests for trioserve.frontend.text.detokenizer, on the tokenizers of ``helpers.tokenizers``.

In the byte-level tokenizer token id ``b < 256`` is the byte ``b``, so a
test can cut any character between tokens by feeding its UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from helpers.tokenizers import BOS, BYTE_MERGES, EOS, PAD, write_byte_level_model, write_llama_style_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.frontend.requests.state import RequestState
from trioserve.frontend.text.detokenizer import (
    MAX_PENDING_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    DetokenizerUpdate,
    IncrementalDetokenizer,
)
from trioserve.frontend.text.tokenizer import TextStreamError, Tokenizer
from trioserve.messages import TokenOutput
from trioserve.sampling_params import SamplingParams

R = "\ufffd"
HEL = 257  # the byte-level merge "hel"
MERGE_IDS = list(range(256, 256 + len(BYTE_MERGES)))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_level_model(tmp_path_factory.mktemp("byte")))


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_llama_style_model(tmp_path_factory.mktemp("llama")))


def utf8_ids(text: str) -> list[int]:
    """Byte-level token ids for ``text``, one byte per token."""
    return list(text.encode())


def stream(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[DetokenizerUpdate]:
    return [detok.update(chunk) for chunk in chunks]


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """``ids`` cut into chunks of the given sizes (cycled)."""
    chunks, start, n = [], 0, 0
    while start < len(ids):
        size = sizes[n % len(sizes)] if sizes else len(ids)
        chunks.append(list(ids[start : start + size]))
        start, n = start + size, n + 1
    return chunks


def first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """What a stop-string check of the whole text should give: the text before
    the stop string that ends first (the longest of those ending together)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, start, stop = min(found)
    return text[:start], stop


def deltas(updates: Sequence[DetokenizerUpdate]) -> list[str]:
    return [u.text_delta for u in updates]


# --- strategies --------------------------------------------------------------

# Valid text, without U+FFFD itself: a model that writes one is held back like
# an unfinished character (and a trailing one is dropped by flush).
texts = st.text(
    st.one_of(st.sampled_from("hel o\nté🙂東京"), st.characters(codec="utf-8", exclude_characters=R)),
    max_size=24,
)
chunk_sizes = st.lists(st.integers(1, 5), max_size=6)


any_byte_level_ids = st.lists(
    st.one_of(st.integers(0, 255), st.sampled_from(MERGE_IDS), st.sampled_from([PAD, BOS, EOS])),
    max_size=40,
)


# --- the incremental decode --------------------------------------------------


@SETTINGS
@given(prompt=texts, out=any_byte_level_ids, sizes=chunk_sizes, skip=st.booleans())
def test_deltas_concatenate_to_the_full_decode_of_any_token_ids(
    byte_tok: Tokenizer, prompt: str, out: list[int], sizes: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode(prompt), skip_special_tokens=skip)
    emitted, seen = "", []
    for chunk in split(out, sizes):
        emitted += detok.update(chunk).text_delta
        seen += chunk
        assert byte_tok.decode(seen, skip_special_tokens=skip).startswith(emitted)
    emitted += detok.flush()
    full = byte_tok.decode(out, skip_special_tokens=skip)
    assert emitted.rstrip(R) == full.rstrip(R)  # flush drops an unfinished character
    if not full.endswith(R):
        assert emitted == full
    assert detok.text == emitted
    assert detok.token_ids == out


@SETTINGS
@given(prompt=texts, out=any_byte_level_ids, llama_text=texts, sizes=chunk_sizes, skip=st.booleans(), data=st.data())
def test_the_stream_and_the_windows_decoded_here_give_the_same_deltas(
    byte_tok: Tokenizer,
    llama_tok: Tokenizer,
    prompt: str,
    out: list[int],
    llama_text: str,
    sizes: list[int],
    skip: bool,
    data: st.DataObject,
) -> None:
    tok = data.draw(st.sampled_from([byte_tok, llama_tok]))
    ids = out if tok is byte_tok else [i % tok.vocab_size for i in out] + tok.encode(llama_text)[1:]
    runs = []
    for failing in (False, True):
        detok = IncrementalDetokenizer(
            CountingTokenizer(tok, failing_streams=failing),  # type: ignore[arg-type]
            tok.encode(prompt),
            skip_special_tokens=skip,
        )
        runs.append([*deltas(stream(detok, split(ids, sizes))), detok.flush()])
    assert runs[0] == runs[1]


@SETTINGS
@given(prompt=texts, text=texts, sizes=chunk_sizes, data=st.data())
def test_characters_cut_between_tokens_never_come_out_as_replacement_chars(
    byte_tok: Tokenizer, prompt: str, text: str, sizes: list[int], data: st.DataObject
) -> None:
    ids = data.draw(st.sampled_from([utf8_ids(text), byte_tok.encode(text)[1:]]))
    for position in data.draw(st.lists(st.integers(0, len(ids)), max_size=5)):
        ids.insert(position, data.draw(st.sampled_from([PAD, BOS, EOS])))  # skipped
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode(prompt))
    out = deltas(stream(detok, split(ids, sizes)))
    assert all(R not in d for d in out)
    assert "".join(out) == text
    assert detok.flush() == ""


@SETTINGS
@given(prompt=texts, text=texts, sizes=chunk_sizes, specials=st.lists(st.integers(0, 40)))
def test_llama_style_deltas_continue_the_prompt_text(
    llama_tok: Tokenizer, prompt: str, text: str, sizes: list[int], specials: list[int]
) -> None:
    prompt_ids = llama_tok.encode(prompt)
    ids = llama_tok.encode(text)[1:]  # without BOS
    for position in specials:  # EOS tokens here and there, skipped
        ids.insert(min(position, len(ids)), llama_tok.eos_token_ids[0])
    detok = IncrementalDetokenizer(llama_tok, prompt_ids)
    out = deltas(stream(detok, split(ids, sizes)))
    out.append(detok.flush())
    whole = llama_tok.decode(prompt_ids + ids)
    assert whole.startswith(llama_tok.decode(prompt_ids))
    assert "".join(out) == whole[len(llama_tok.decode(prompt_ids)) :]
    assert all(R not in d for d in out)


def test_deltas_of_a_simple_output(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("say:"))
    out = deltas(stream(detok, one_by_one(byte_tok.encode(" hello there")[1:])))
    assert "".join(out) == " hello there"
    assert detok.text == " hello there"


def test_multibyte_characters_come_out_whole(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [])
    out = deltas(stream(detok, one_by_one(utf8_ids("é🙂東"))))
    # é is 2 bytes, 🙂 4, 東 3: each comes out with its last byte.
    assert out == ["", "é", "", "", "", "🙂", "", "", "東"]


def test_character_cut_by_a_merge_token(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode(" él")[1:]
    assert ids == [259, 260]  # " \xc3" and "\xa9l"
    detok = IncrementalDetokenizer(byte_tok, [])
    assert deltas(stream(detok, one_by_one(ids))) == ["", " él"]


def test_special_tokens_are_skipped_unless_asked(byte_tok: Tokenizer) -> None:
    ids = [ord("h"), EOS, ord("i"), BOS]
    skipped = IncrementalDetokenizer(byte_tok, [])
    assert "".join(deltas(stream(skipped, one_by_one(ids)))) == "hi"
    kept = IncrementalDetokenizer(byte_tok, [], skip_special_tokens=False)
    assert "".join(deltas(stream(kept, one_by_one(ids)))) == "h</s>i<s>"


def test_llama_style_first_delta_keeps_its_leading_space(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("world")[1:]
    after_prompt = IncrementalDetokenizer(llama_tok, llama_tok.encode("hello"))
    assert "".join(deltas(stream(after_prompt, one_by_one(ids)))) == " world"
    no_prompt = IncrementalDetokenizer(llama_tok, [])
    assert "".join(deltas(stream(no_prompt, one_by_one(ids)))) == "world"


class CountingTokenizer:
    """Passes ``decode`` and ``decode_stream`` on, noting the longest list of
    ids either was given, and how many ids went to ``decode`` in all; with
    ``failing_streams``, each stream raises at its first step."""

    def __init__(self, tokenizer: Tokenizer, *, failing_streams: bool = False) -> None:
        self.tokenizer = tokenizer
        self.failing_streams = failing_streams
        self.longest = 0
        self.decoded_ids = 0
        self.streams = 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], *, skip_special_tokens: bool = True) -> object:
        self.longest = max(self.longest, len(context_ids))
        self.streams += 1
        if self.failing_streams:
            return FailingStream()
        return self.tokenizer.decode_stream(context_ids, skip_special_tokens=skip_special_tokens)


class FailingStream:
    def step(self, token_id: int) -> str | None:
        raise TextStreamError(f"planted failure at token {token_id}")


@pytest.mark.parametrize("failing_streams", [False, True], ids=["stream", "windows-decoded-here"])
def test_each_update_decodes_a_bounded_window(byte_tok: Tokenizer, failing_streams: bool) -> None:
    spy = CountingTokenizer(byte_tok, failing_streams=failing_streams)
    ids = utf8_ids("héllo wörld 🙂 東京 " * 200)
    detok = IncrementalDetokenizer(spy, byte_tok.encode("prompt " * 100))  # type: ignore[arg-type]
    stream(detok, one_by_one(ids))
    assert detok.text == byte_tok.decode(ids)
    assert spy.longest <= PROMPT_CONTEXT_TOKENS + 4
    if failing_streams:  # one stream, and after its failure no other
        assert spy.streams == 1
    else:  # the stream decodes every token: here only the prompt's context was
        assert spy.decoded_ids == PROMPT_CONTEXT_TOKENS


def test_a_long_run_of_invalid_utf8_is_released(byte_tok: Tokenizer) -> None:
    spy = CountingTokenizer(byte_tok)
    ids = [0x80] * 100 + [0xE2, 0x82, 0xAC] + [0xF0] * 50 + [ord("a")]
    detok = IncrementalDetokenizer(spy, [])  # type: ignore[arg-type]
    out = deltas(stream(detok, one_by_one(ids)))
    released = "".join(out[:100])  # not held back until the end
    assert set(released) == {R} and len(released) >= 100 - MAX_PENDING_TOKENS - 1
    assert "".join(out) + detok.flush() == byte_tok.decode(ids)
    assert spy.longest <= 2 * MAX_PENDING_TOKENS + 2


# --- stop strings ------------------------------------------------------------


def test_stop_string_inside_one_token(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["el"])
    updates = stream(detok, [[HEL], [ord("l")]])
    assert updates == [DetokenizerUpdate("h", "el"), DetokenizerUpdate("")]
    assert detok.text == "h"
    assert detok.stop_string == "el"
    assert detok.token_ids == [HEL]


def test_stop_string_spanning_tokens(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["llo"])
    updates = stream(detok, [[HEL], [ord("l")], [ord("o")], [ord("!")]])
    assert updates == [
        DetokenizerUpdate("he"),
        DetokenizerUpdate(""),
        DetokenizerUpdate("", "llo"),
        DetokenizerUpdate(""),
    ]
    assert detok.text == "he"
    assert detok.flush() == ""


def test_stop_string_at_the_very_start(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("x"), stop=["he"])
    assert detok.update([HEL]) == DetokenizerUpdate("", "he")
    assert detok.text == ""


def test_stop_string_completing_a_cut_character(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["é"])
    assert stream(detok, [[259], [260]]) == [DetokenizerUpdate(""), DetokenizerUpdate(" ", "é")]


@pytest.mark.parametrize(
    ("stops", "text", "stop"),
    [
        (["lo", "ell"], "h", "ell"),  # "ell" is complete first
        (["ello", "el"], "h", "el"),
        (["llo", "lo"], "he", "llo"),  # end together: the longest
        (["xyz", "o"], "hell", "o"),
    ],
)
def test_the_stop_string_complete_first_wins(byte_tok: Tokenizer, stops: list[str], text: str, stop: str) -> None:
    ids = byte_tok.encode("hello world")[1:]
    for chunks in (one_by_one(ids), [ids]):
        detok = IncrementalDetokenizer(byte_tok, [], stop=stops)
        updates = stream(detok, chunks)
        assert "".join(deltas(updates)) == text
        assert [u.stop_string for u in updates if u.stop_string] == [stop]


def test_partial_stop_string_is_held_back_then_released(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["lp"])
    updates = stream(detok, [[HEL], [ord("l")], [ord("o")]])
    assert deltas(updates) == ["he", "l", "lo"]
    assert all(u.stop_string is None for u in updates)


def test_longest_possible_stop_prefix_is_held_back(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["aab"])
    updates = stream(detok, one_by_one(utf8_ids("xaaab")))
    assert deltas(updates) == ["x", "", "", "a", ""]
    assert updates[-1].stop_string == "aab"
    assert detok.text == "xa"


def test_flush_releases_a_held_back_stop_prefix(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["o!"])
    assert "".join(deltas(stream(detok, [[HEL], [ord("l")], [ord("o")]]))) == "hell"
    assert detok.flush() == "o"
    assert detok.text == "hello"


def test_flush_drops_an_unfinished_character(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [])
    assert deltas(stream(detok, [[ord("a")], [0xE6, 0x9D]])) == ["a", ""]
    assert detok.flush() == ""
    other = IncrementalDetokenizer(byte_tok, [])
    assert other.update([259]) == DetokenizerUpdate("")  # " \xc3": a space, half an "é"
    assert other.flush() == " "
    assert other.text == " "


def test_flush_still_cuts_at_a_stop_string(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["a "])
    assert stream(detok, [[ord("x"), ord("a")], [259]]) == [
        DetokenizerUpdate("x"),
        DetokenizerUpdate(""),
    ]
    assert detok.flush() == ""
    assert detok.stop_string == "a "
    assert detok.text == "x"


@pytest.mark.parametrize("engine_reason", ["length", "stop"])
def test_a_stop_string_completed_by_the_last_flush_is_the_requests_stop_reason(
    byte_tok: Tokenizer, engine_reason: str
) -> None:
    """The request ends (its length, or EOS) on a token whose text was held
    back (" \xc3": a space, half a character) and completes "a ": the text
    is cut there, and the output says so, as for a stop string found earlier."""
    state = RequestState("r", [5], SamplingParams(max_tokens=3, stop=["a "]), byte_tok)
    state.process(TokenOutput("r", [ord("x"), ord("a")]))
    state.process(TokenOutput("r", [259], engine_reason))
    out = state.collector.poll()
    assert out is not None
    assert (out.cumulative_text, out.finish_reason, out.stop_reason) == ("x", "stop", "a ")
    assert state.finished


def test_empty_stop_string_is_rejected(byte_tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(byte_tok, [], stop=["ok", ""])


@SETTINGS
@given(text=texts, sizes=chunk_sizes, data=st.data())
def test_stop_strings_do_not_depend_on_how_tokens_are_split(
    byte_tok: Tokenizer, text: str, sizes: list[int], data: st.DataObject
) -> None:
    substrings = st.tuples(st.integers(0, len(text)), st.integers(1, 4)).map(lambda t: text[t[0] : t[0] + t[1]])
    stops = data.draw(st.lists(st.one_of(substrings, st.text(min_size=1, max_size=3)).filter(bool), max_size=4))
    ids = data.draw(st.sampled_from([utf8_ids(text), byte_tok.encode(text)[1:]]))
    detok = IncrementalDetokenizer(byte_tok, [], stop=stops)
    updates = stream(detok, split(ids, sizes))
    found = [u.stop_string for u in updates if u.stop_string is not None]
    emitted = "".join(deltas(updates)) + detok.flush()
    expected_text, expected_stop = first_stop(text, stops)
    assert emitted == expected_text
    assert found == ([] if expected_stop is None else [expected_stop])
    assert detok.stop_string == expected_stop


def test_thousands_of_overlapping_stop_strings_cut_at_the_first(byte_tok: Tokenizer) -> None:
    stops = [f"{n:04d}" for n in range(10_000) if n != 1234] + ["234", "x1234"]
    detok = IncrementalDetokenizer(byte_tok, [], stop=stops)
    updates = stream(detok, one_by_one(utf8_ids("ab x12345 y")))
    # "234" and "x1234" are complete first, together ("2345" only after them).
    assert "".join(deltas(updates)) == "ab "
    assert detok.stop_string == "x1234"


def test_text_after_flush_does_not_complete_a_stop_string_begun_before(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["ab"])
    assert detok.update([ord("a")]) == DetokenizerUpdate("")
    assert detok.flush() == "a"
    assert detok.update([ord("b")]) == DetokenizerUpdate("b")


# --- include_stop_str_in_output, min_tokens, and the text of a stop token -----


@SETTINGS
@given(
    text=texts,
    stops=st.lists(st.sampled_from(["l", "lo", "é", "o w", "🙂"]), min_size=1, max_size=3),
    sizes=chunk_sizes,
)
def test_an_included_stop_string_ends_the_text_however_the_tokens_are_split(
    byte_tok: Tokenizer, text: str, stops: list[str], sizes: list[int]
) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=stops, include_stop_str_in_output=True)
    updates = stream(detok, split(utf8_ids(text), sizes))
    before, stop = first_stop(text, stops)
    got = "".join(deltas(updates)) + detok.flush()
    assert got == (before + stop if stop is not None else text) == detok.text
    assert [u.stop_string for u in updates if u.stop_string] == ([stop] if stop else [])


def test_an_included_stop_string_holds_nothing_back(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["llo"], include_stop_str_in_output=True)
    assert deltas(stream(detok, [[HEL], [ord("l")], [ord("o")], [ord("!")]])) == ["hel", "l", "o", ""]


@pytest.mark.parametrize(
    "chunks", [[[HEL], [ord("l")], [ord("o")], [ord("l")], [ord("o")]], [[HEL, 108, 111, 108, 111]]]
)
def test_no_stop_string_counts_in_the_text_of_the_first_min_tokens_tokens(
    byte_tok: Tokenizer, chunks: list[list[int]]
) -> None:
    # "hel", "l", "o": the first three tokens, whose "lo" does not count; the next "lo" does.
    detok = IncrementalDetokenizer(byte_tok, [], stop=["lo"], min_tokens=3)
    updates = stream(detok, chunks)
    assert "".join(deltas(updates)) == "hell" + "o" and detok.stop_string == "lo"


def test_a_stop_token_or_eos_that_ends_the_request_leaves_its_text_out_unless_asked(byte_tok: Tokenizer) -> None:
    for include, text in ((False, "xy"), (True, "xyz")):
        for ends_by in ({"stop_token_ids": [ord("z")]}, {}):
            params = SamplingParams(include_stop_str_in_output=include, **ends_by)
            eos = [] if ends_by else [ord("z")]  # without a stop token id, "z" is the model's EOS
            state = RequestState("r", [5], params, byte_tok, eos_token_ids=eos)
            state.process(TokenOutput("r", [ord("x"), ord("y")]))
            state.process(TokenOutput("r", [ord("z")], "stop"))
            out = state.collector.poll()
            assert out is not None and out.cumulative_text == text and out.token_ids[-1] == ord("z")
    # Ended by length, the last token's text is the text's end.
    state = RequestState("r", [5], SamplingParams(stop_token_ids=[ord("z")]), byte_tok)
    state.process(TokenOutput("r", [ord("z")], "length"))
    out = state.collector.poll()
    assert out is not None and out.cumulative_text == "z"
