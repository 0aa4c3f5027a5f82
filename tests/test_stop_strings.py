"""Tests for trioserve.frontend.text.stop_strings, against a naive reference."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.frontend.text.stop_strings import StopMatch, StopStringMatcher

SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_first_match(text: str, stops: Sequence[str]) -> StopMatch | None:
    """The stop string that ends earliest in ``text``, the longest of those
    ending together, by trying every end and every stop string."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if text.endswith(s, 0, end)]
        if ending_here:
            stop = max(ending_here, key=len)
            return StopMatch(stop, end - len(stop), end)
    return None


def naive_held_back(text: str, stops: Sequence[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop string."""
    tails = range(1, len(text) + 1)
    return max((n for n in tails for s in stops if len(s) > n and s.startswith(text[-n:])), default=0)


def split(text: str, sizes: Sequence[int]) -> list[str]:
    """``text`` cut into pieces of the given sizes (cycled; 0 makes an empty feed)."""
    pieces, start, n = [], 0, 0
    while start < len(text):
        size = sizes[n % len(sizes)] if sizes else len(text)
        pieces.append(text[start : start + size])
        start, n = start + size, n + 1
    return pieces


def feed_all(matcher: StopStringMatcher, pieces: Sequence[str]) -> StopMatch | None:
    for piece in pieces:
        match = matcher.feed(piece)
        if match is not None:
            return match
    return None


# --- against the naive reference ---------------------------------------------

alphabets = st.sampled_from(["a", "ab", "abc", "aé🙂", "ab\n "])


@st.composite
def texts_and_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A text over a small alphabet, and stop strings over the same alphabet:
    some cut from the text (so that they are found, and overlap each other),
    some arbitrary (prefixes, suffixes and substrings of each other happen
    often with so few letters)."""
    alphabet = draw(alphabets)
    text = draw(st.text(st.sampled_from(alphabet), max_size=30))
    cut = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(lambda t: text[t[0] : t[0] + t[1]])
    free = st.text(st.sampled_from(alphabet), min_size=1, max_size=6)
    stops = draw(st.lists(st.one_of(cut, free).filter(bool), max_size=8))
    return text, stops


@SETTINGS
@given(case=texts_and_stops(), sizes=st.lists(st.integers(0, 7), max_size=6).filter(lambda s: any(s) or not s))
def test_matches_the_naive_answer_however_the_text_is_fed(case: tuple[str, list[str]], sizes: list[int]) -> None:
    text, stops = case
    matcher = StopStringMatcher(stops)
    fed = ""
    for piece in split(text, sizes):
        expected = naive_first_match(fed + piece, stops)
        match = matcher.feed(piece)
        if expected is not None:
            assert match == expected
            assert matcher.num_fed == expected.end
            assert matcher.held_back == 0
            return
        fed += piece
        assert match is None
        assert matcher.num_fed == len(fed)
        assert matcher.held_back == naive_held_back(fed, stops)
    assert naive_first_match(text, stops) is None


@SETTINGS
@given(case=texts_and_stops(), first=st.integers(0, 30))
def test_after_reset_only_what_follows_counts(case: tuple[str, list[str]], first: int) -> None:
    text, stops = case
    before, after = text[:first], text[first:]
    matcher = StopStringMatcher(stops)
    if matcher.feed(before) is not None:
        return
    matcher.reset()
    match = matcher.feed(after)
    expected = naive_first_match(after, stops)
    if expected is None:
        assert match is None
        assert matcher.held_back == naive_held_back(after, stops)
    else:
        assert match == StopMatch(expected.stop, expected.start + len(before), expected.end + len(before))


# --- named cases -------------------------------------------------------------


def test_the_stop_string_that_ends_first_wins_over_one_that_starts_first() -> None:
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == StopMatch("bc", 2, 4)
    assert matcher.num_fed == 4  # the "d" after the match is not consumed


def test_of_stop_strings_ending_together_the_longest_wins() -> None:
    matcher = StopStringMatcher(["cd", "abcd", "bcd"])
    assert matcher.feed("xab") is None
    assert matcher.feed("cd") == StopMatch("abcd", 1, 5)


def test_a_stop_string_across_feeds_reports_stream_offsets() -> None:
    matcher = StopStringMatcher(["lo w"])
    for piece in ["hel", "l", "o", " "]:
        assert matcher.feed(piece) is None
    assert matcher.held_back == 3
    assert matcher.feed("world") == StopMatch("lo w", 3, 7)


def test_held_back_follows_failure_links() -> None:
    matcher = StopStringMatcher(["ababc", "bad"])
    assert matcher.feed("xabab") is None
    assert matcher.held_back == 4  # "abab"
    assert matcher.feed("a") is None
    assert matcher.held_back == 3  # "aba", a shorter prefix of "ababc"
    assert matcher.feed("d") == StopMatch("bad", 4, 7)  # "ba" was held back too


def test_a_character_no_stop_string_has_releases_everything() -> None:
    matcher = StopStringMatcher(["ababc"])
    assert matcher.feed("abab") is None
    assert matcher.feed("x") is None
    assert matcher.held_back == 0


def test_a_stop_string_inside_another_is_found_first() -> None:
    matcher = StopStringMatcher(["aXXXb", "X"])
    assert matcher.feed("aX") == StopMatch("X", 1, 2)


def test_duplicate_stop_strings_count_once() -> None:
    matcher = StopStringMatcher(["end", "end", "stop"])
    assert matcher.stops == ("end", "stop")
    assert matcher.feed("the end") == StopMatch("end", 4, 7)


def test_without_stop_strings_nothing_is_found_or_held_back() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything at all") is None
    assert matcher.held_back == 0
    assert matcher.num_fed == 15


def test_feeding_after_a_match_is_refused_until_reset() -> None:
    matcher = StopStringMatcher(["!"])
    assert matcher.feed("hi!") == StopMatch("!", 2, 3)
    with pytest.raises(RuntimeError, match="already found"):
        matcher.feed("more")
    matcher.reset()
    assert matcher.match is None
    assert matcher.feed("ok!") == StopMatch("!", 5, 6)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])
