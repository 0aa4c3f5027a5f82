"""Stop-string matching over a stream of text, in time linear in the text.

``StopStringMatcher`` is an Aho–Corasick automaton over a fixed set of stop
strings, built once in time proportional to their total length:

- ``goto``: the trie of the stop strings. Node 0 is the root (the empty
  string); every other node is a prefix of some stop string, ``depth[n]``
  characters long.
- ``fail[n]``: the node of the longest proper suffix of node ``n``'s string
  that is also in the trie.
- ``longest[n]``: the index of the longest stop string that is a suffix of
  node ``n``'s string (``-1`` for none): its own, else ``longest[fail[n]]``.

Text is fed in pieces. Invariants: ``state`` is the node of the longest
suffix of the text fed since the last ``reset`` that is in the trie; while no
stop string was found that suffix is a proper prefix of a stop string, and no
longer suffix is, so ``held_back == depth[state]`` is exactly the tail that
could still become a stop string. The first match is the occurrence that
ends earliest in the stream, and of those ending together the longest: it
does not depend on how the text was split into feeds. Each character costs
amortised O(1): it moves ``state`` one character deeper at most, and each
``fail`` step makes it shallower.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string found in the stream: ``stop`` occupies the stream's
    characters ``start:end`` (offsets since the matcher was made)."""

    stop: str
    start: int
    end: int


class StopStringMatcher:
    """Finds the first stop string in text fed piece by piece, and says how
    much of the text's tail could still begin one.

    ``feed`` stops at the first match and the matcher is then spent: feeding
    it more raises ``RuntimeError`` until ``reset``. With no stop strings,
    ``feed`` only counts characters.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: must be non-empty strings (got {list(stop)!r})")
        self._stops = tuple(dict.fromkeys(stop))
        self._goto: list[dict[str, int]] = [{}]
        self._depth: list[int] = [0]
        self._longest: list[int] = [-1]
        for index, stop_string in enumerate(self._stops):
            self._longest[self._insert(stop_string)] = index
        self._fail: list[int] = [0] * len(self._goto)
        self._link_failures()
        self._state = 0
        self._num_fed = 0
        self.match: StopMatch | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings, without duplicates, in the order given."""
        return self._stops

    @property
    def num_fed(self) -> int:
        """Characters consumed so far: all those fed, or up to the end of the
        match. Stream offsets count from the first feed, across resets."""
        return self._num_fed

    @property
    def held_back(self) -> int:
        """How many trailing characters of the text fed since the last reset
        could be the beginning of a stop string (0 once a match is found)."""
        return 0 if self.match is not None else self._depth[self._state]

    def reset(self) -> None:
        """Forgets the text fed so far, and any match: a stop string must lie
        wholly in what is fed after this. Offsets keep counting."""
        self._state = 0
        self.match = None

    def feed(self, text: str) -> StopMatch | None:
        """Scans ``text``, the stream's next characters, and returns the first
        stop string that completes in it (``None`` if none does). Characters
        after the match are not consumed."""
        if self.match is not None:
            raise RuntimeError("feed: a stop string was already found (reset first)")
        if not self._stops:
            self._num_fed += len(text)
            return None
        goto, fail, longest = self._goto, self._fail, self._longest
        state = self._state
        for i, char in enumerate(text):
            child = goto[state].get(char)
            while child is None and state:
                state = fail[state]
                child = goto[state].get(char)
            state = child or 0
            if longest[state] >= 0:
                self._state = state
                return self._found(self._stops[longest[state]], self._num_fed + i + 1)
        self._state = state
        self._num_fed += len(text)
        return None

    def _found(self, stop: str, end: int) -> StopMatch:
        self._num_fed = end
        self.match = StopMatch(stop, end - len(stop), end)
        return self.match

    # --- building the automaton ----------------------------------------------

    def _insert(self, stop: str) -> int:
        """Adds ``stop`` to the trie; returns its node."""
        node = 0
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = len(self._goto)
                self._goto[node][char] = child
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._longest.append(-1)
            node = child
        return node

    def _link_failures(self) -> None:
        """Sets ``fail`` and completes ``longest``, shallowest nodes first, so
        that a node's failure link is done before its children need it."""
        queue = deque(self._goto[0].values())  # depth 1: they fail to the root
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                queue.append(child)
                suffix = self._fail[node]
                while suffix and char not in self._goto[suffix]:
                    suffix = self._fail[suffix]
                self._fail[child] = self._goto[suffix].get(char, 0)
                if self._longest[child] < 0:
                    self._longest[child] = self._longest[self._fail[child]]
