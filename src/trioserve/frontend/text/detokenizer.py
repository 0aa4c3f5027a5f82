"""Incremental detokenization: a request's new token ids in, text deltas out.

Two things are held back from a delta until they are settled:

- An incomplete UTF-8 character. A byte-level token can carry part of a
  character; the tokenizer decodes the part as U+FFFD. While the decoded text
  ends with U+FFFD the tokens stay pending, and the character comes out whole
  with the token that completes it.
- A tail that could be the start of a stop string. It comes out as soon as it
  can no longer begin one, or is cut off with the stop string when it does.
  The decoded text is fed once to a ``StopStringMatcher`` (an Aho–Corasick
  automaton built per request, in time proportional to the total length of
  the stop strings), which finds stop strings across token boundaries and
  says how long that tail is: an update costs its new text, however many
  stop strings there are, and never rescans what came before. The tail is
  shorter than the longest stop string and is kept as the pieces it came in,
  so releasing it costs what comes out.

Each token is decoded in a bounded window, not with the whole output: the
tokens of the previous delta (``prefix_offset:read_offset``, context for
decoders whose output depends on the token before, such as SentencePiece's
leading space) and the pending tokens after them. The first window reaches a
few tokens into the prompt for the same reason. The tokenizer's
``TextStream`` (the ``tokenizers`` library's own, in native code) keeps that
window; this module keeps the same offsets beside it, to cut a long run of
invalid UTF-8 (which the stream would hold forever) and to decode the window
itself should the stream fail (a decoder whose text for the window does not
begin with the text already out).

With ``include_stop_str_in_output`` the stop string ends the text instead
of being cut off, and nothing is held back (what may begin a stop string
may come out: so would the stop string). With ``min_tokens`` the text of
the first ``min_tokens`` tokens is never searched: a stop string counts only
in the text after it.

Invariants: ``prefix_offset <= read_offset <= len(all token ids)``; until a
stop string is found, the decoded text is the emitted text and then the
held-back text, as long as the matcher's ``held_back``; the emitted text
never contains a stop string (unless included, as its end); once a stop string is found no further text
comes out; the deltas do not depend on how the token ids were split into
updates. Without a stop string, the deltas and ``flush()`` together equal
``tokenizer.decode(token_ids)`` less any U+FFFD at its end, wherever more
tokens cannot change the text of those before them (always for byte-level
BPE; for SentencePiece byte fallback, on valid UTF-8, since it turns a whole
run of byte tokens into U+FFFD when one byte is invalid).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from trioserve.frontend.text.stop_strings import StopStringMatcher
from trioserve.frontend.text.tokenizer import TextStream, TextStreamError, Tokenizer

# Prompt tokens decoded as context before the first output token.
PROMPT_CONTEXT_TOKENS = 5
# Pending tokens whose text still ends in U+FFFD after this many are invalid
# UTF-8, not an unfinished character (one spans at most 3 tokens): they are
# released, so that a model emitting garbage (or only skipped special tokens)
# cannot grow the window forever.
MAX_PENDING_TOKENS = 16

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one ``update`` produced.

    ``text_delta`` is the new text, cut before the stop string if one was
    found; ``stop_string`` names that stop string, only in the update that
    found it.
    """

    text_delta: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns a request's stream of new token ids into text deltas, holding
    back incomplete UTF-8 (decoded as U+FFFD) and any tail that could be the
    start of a stop string; finds stop strings across token boundaries.

    When several stop strings appear, the one that is complete first (ends
    earliest in the text) wins, and of those ending at the same place the
    longest: so the result does not depend on how the tokens were split into
    updates. Token ids given after a stop string was found are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._matcher = StopStringMatcher(stop)  # ValueError on an empty stop string
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._unsearched_tokens = min_tokens  # output tokens whose text no stop string may lie in
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # window context, then output ids
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        # None while the windows are decoded here (see _start_stream)
        self._stream: TextStream | None = None
        self._stream_failed = False
        self._start_stream()
        self._held = _HeldText()  # decoded text that may begin a stop string
        self._chunks: list[str] = []  # emitted text, joined lazily by ``text``
        self.stop_string: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """The output token ids so far (those given after a stop string was
        found are not kept)."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far: the deltas and ``flush()`` together."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found (no more text will come out)."""
        return self.stop_string is not None

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Adds the request's next token ids and returns the text they settle."""
        if self.stopped or not new_token_ids:
            return DetokenizerUpdate("")
        # One token at a time, as if each had come alone: a decoder that turns
        # a whole run of byte tokens into U+FFFD while its last character is
        # unfinished (SentencePiece byte fallback) would otherwise hold back
        # everything when several tokens arrive at once.
        unsearched: list[str] = []
        settled: list[str] = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            text = self._settled_text()
            (unsearched if len(self._ids) - self._num_context <= self._unsearched_tokens else settled).append(text)
        head = "".join(unsearched)  # nothing is held back before it: it comes first
        self._append(head, None)
        update = self._emit("".join(settled), final=False)
        return DetokenizerUpdate(head + update.text_delta, update.stop_string) if head else update

    def flush(self) -> str:
        """Releases what is held back, at the end of a request that finished
        for another reason (length, EOS, abort). An unfinished character at
        the very end is dropped; a stop string completed by the released text
        still cuts it."""
        if self.stopped:
            return ""
        pending = self._decode_new(len(self._ids)).rstrip(_REPLACEMENT)
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(pending, final=True).text_delta

    # --- incomplete UTF-8 ----------------------------------------------------

    def _settled_text(self) -> str:
        """The text of the pending tokens (the last one just added), once
        there is some and it does not end with an unfinished character; ``""``
        until then. Moves the offsets when it returns text."""
        end = len(self._ids)
        new_text = self._step_stream(self._ids[-1])
        # No text yet (a skipped special token) also waits: moving the offsets
        # past it would leave the next token without its context.
        if new_text is None:
            if end - self._read_offset <= MAX_PENDING_TOKENS:
                return ""
            return self._release_garbage()
        self._prefix_offset, self._read_offset = self._read_offset, end
        if self._stream is None:
            self._start_stream()
        return new_text

    def _start_stream(self) -> None:
        """Starts a stream on the context ``ids[prefix_offset:read_offset]``,
        unless one failed or the context's text ends with U+FFFD (a stream
        would return that text again: the windows are decoded here until the
        next delta)."""
        if self._stream_failed:
            return
        if self._decode(self._prefix_offset, self._read_offset).endswith(_REPLACEMENT):
            return
        context = self._ids[self._prefix_offset : self._read_offset]
        self._stream = self._tokenizer.decode_stream(context, skip_special_tokens=self._skip_special_tokens)

    def _step_stream(self, token_id: int) -> str | None:
        """The stream's text for the token just added, or ``None`` while it
        settles none. Without a stream, the window decoded here."""
        if self._stream is not None:
            try:
                return self._stream.step(token_id)
            except TextStreamError:
                self._stream, self._stream_failed = None, True
        new_text = self._decode_new(len(self._ids))
        return None if not new_text or new_text.endswith(_REPLACEMENT) else new_text

    def _release_garbage(self) -> str:
        """Releases a long run of pending invalid UTF-8 up to a cut that
        later tokens cannot change, and steps the tokens after the cut into a
        new stream (their text, if they settle some, comes out too)."""
        cut = self._garbage_cut()
        released = self._decode_new(cut)
        self._prefix_offset, self._read_offset = self._read_offset, cut
        after = self._ids[cut:]
        del self._ids[cut:]
        self._stream = None
        self._start_stream()
        texts = [released]
        for token_id in after:
            self._ids.append(token_id)
            texts.append(self._settled_text())
        return "".join(texts)

    def _decode_new(self, end: int) -> str:
        """The text that ``ids[read_offset:end]`` adds after the context
        ``ids[prefix_offset:read_offset]``."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._decode(self._prefix_offset, end)[len(prefix_text) :]

    def _garbage_cut(self) -> int:
        """Where to split a long run of invalid UTF-8: the last token boundary
        that decoding on either side of does not change the text, with text
        right after it, so that later tokens cannot turn what is before it
        into a character."""
        start, end = self._prefix_offset, len(self._ids)
        whole = self._decode(start, end)
        for cut in range(end - 1, self._read_offset, -1):
            after = self._decode(cut, end)
            if self._decode(cut, cut + 1) and self._decode(start, cut) + after == whole:
                return cut
        return end - 4  # keeps more tokens than an unfinished character spans

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    # --- stop strings --------------------------------------------------------

    def _emit(self, new_text: str, *, final: bool) -> DetokenizerUpdate:
        """Feeds ``new_text`` to the matcher behind the held-back tail, cuts at
        the first stop string, and emits all but what may still begin one
        (unless ``final``, which also forgets the tail for the matcher)."""
        if not self._matcher.stops:  # nothing to find, nothing to hold back
            return self._append(new_text, None)
        held_start = self._matcher.num_fed - self._held.length  # stream offset
        match = self._matcher.feed(new_text)
        self._held.push(new_text)
        if match is not None:
            self.stop_string = match.stop
            delta = self._held.pop((match.end if self._include_stop else match.start) - held_start)
            self._held = _HeldText()
            return self._append(delta, match.stop)
        keep = 0 if final or self._include_stop else self._matcher.held_back
        if final:
            self._matcher.reset()
        return self._append(self._held.pop(self._held.length - keep), None)

    def _append(self, delta: str, stop: str | None) -> DetokenizerUpdate:
        if delta:
            self._chunks.append(delta)
        return DetokenizerUpdate(delta, stop)


class _HeldText:
    """Text waiting to come out, first in first out, as the pieces it came in:
    ``push`` and ``pop`` cost the characters they move, not those held."""

    def __init__(self) -> None:
        self._pieces: deque[str] = deque()
        self._skip = 0  # characters of the first piece already popped
        self.length = 0

    def push(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.length += len(text)

    def pop(self, count: int) -> str:
        """Removes and returns the first ``count`` characters (at most
        ``length``)."""
        self.length -= count
        parts: list[str] = []
        while count:
            first = self._pieces[0]
            end = min(len(first), self._skip + count)
            parts.append(first[self._skip : end])
            count -= end - self._skip
            if end == len(first):
                self._pieces.popleft()
                self._skip = 0
            else:
                self._skip = end
        return "".join(parts)
