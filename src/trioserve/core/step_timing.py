"""How long a model step may take before it counts as hung.

Steps are grouped by size: a bucket per power of two of the tokens they
compute. ``StepTiming`` remembers the slowest step seen in each bucket. A
step's deadline is ``factor`` times the slowest step seen of its size (or,
when none of its size was seen, of the nearest larger size), but never less
than ``min_s``; and never more than ``limit_s``, the fixed step timeout,
which is also the deadline while nothing of that size or larger was seen.

Invariants: a deadline is always in ``[min_s, limit_s]`` (``limit_s`` None:
no upper bound, and no deadline while nothing was seen); the slowest time of
a bucket only grows.
"""

from __future__ import annotations

import math


def bucket_of(num_tokens: int) -> int:
    """The size bucket of a step of ``num_tokens`` tokens (0 for a step with none)."""
    return max(num_tokens, 0).bit_length()


class StepTiming:
    """The slowest step seen per size bucket, and the deadlines they give."""

    def __init__(self, *, factor: float, min_s: float, limit_s: float | None) -> None:
        if factor < 1 or min_s <= 0 or (limit_s is not None and limit_s <= 0):
            raise ValueError("factor must be >= 1, min_s and limit_s > 0")
        self.factor = factor
        self.min_s = min_s
        self.limit_s = limit_s
        self._slowest: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds``."""
        bucket = bucket_of(num_tokens)
        self._slowest[bucket] = max(self._slowest.get(bucket, 0.0), seconds)

    def slowest(self, num_tokens: int) -> float | None:
        """The slowest step seen of this size, or of the nearest larger size; None if neither."""
        bucket = bucket_of(num_tokens)
        larger = [b for b in self._slowest if b >= bucket]
        return self._slowest[min(larger)] if larger else None

    def deadline(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` tokens may run (``inf``: no limit)."""
        limit = math.inf if self.limit_s is None else self.limit_s
        slowest = self.slowest(num_tokens)
        if slowest is None:
            return limit
        return min(limit, max(self.min_s, self.factor * slowest))

    def describe(self, num_tokens: int) -> str:
        """What the deadline of such a step is made of, for error messages."""
        slowest = self.slowest(num_tokens)
        if slowest is None or self.deadline(num_tokens) == self.limit_s:
            return f"step_timeout_s={self.limit_s}s"
        return (
            f"{self.deadline(num_tokens):.1f}s ({self.factor:g} x the slowest step of its size so far, "
            f"{slowest * 1000:.1f} ms, and at least step_hang_min_s={self.min_s:g}s)"
        )
