"""Per-request timings in, the benchmark's figures out. No I/O.

Definitions (times from ``time.perf_counter``, in seconds):

- time to first token (TTFT): from sending the request to receiving its
  first output token;
- inter-token latency (ITL): the gap between consecutive deliveries of a
  request, divided evenly among the tokens of the later delivery (a client
  that lags gets several tokens merged into one delivery: each counts as
  having taken its share of the gap, never zero);
- end-to-end latency (E2E): from sending to the last token;
- throughput: completed requests and output tokens over the run's duration,
  from the first request sent to the last request finished.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What a driver observed of one request."""

    index: int
    num_prompt_tokens: int
    num_asked_tokens: int
    sent_s: float = math.nan
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    finished_s: float = math.nan
    finish_reason: str | None = None
    error: str | None = None

    def deliver(self, now: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.deliveries.append((now, num_tokens))

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.deliveries)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.deliveries)

    @property
    def ttft(self) -> float:
        return self.deliveries[0][0] - self.sent_s

    @property
    def e2e(self) -> float:
        return self.deliveries[-1][0] - self.sent_s

    def itls(self) -> list[float]:
        gaps = []
        for (before, _), (now, n) in itertools.pairwise(self.deliveries):
            gaps.extend([(now - before) / n] * n)
        return gaps


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": mean,
        "max": max(values, default=math.nan),
        "count": len(values),
    }


def run_window(records: list[RequestRecord]) -> tuple[float, float]:
    """From the first request sent to the last completed request's end."""
    start = min((r.sent_s for r in records), default=math.nan)
    end = max((r.finished_s for r in records if r.ok), default=math.nan)
    return start, end


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    """The run's figures (see the module docstring)."""
    done = [r for r in records if r.ok]
    start, end = run_window(records)
    duration = end - start if done else math.nan
    output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": sum(r.error is not None for r in records),
        "num_short": sum(r.num_output_tokens != r.num_asked_tokens for r in done),
        "duration_s": duration,
        "prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "requests_per_s": len(done) / duration if done else math.nan,
        "output_tokens_per_s": output_tokens / duration if done else math.nan,
        "ttft_s": distribution([r.ttft for r in done]),
        "itl_s": distribution([gap for r in done for gap in r.itls()]),
        "e2e_s": distribution([r.e2e for r in done]),
        "first_errors": [r.error for r in records if r.error is not None][:3],
    }
