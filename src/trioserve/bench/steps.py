"""The worker's step log (``runners.steplog``) turned into figures of the run.

``in_run_figures`` turns the lines that fall in the measured window into the
same-run counterparts of the model-only baseline: the time the model was
busy, its step time counted once per inter-token gap the step ended (the ITL
the run would have had with no overhead, at exactly its batch shapes and
at the same moment), and the worker's idle time between steps (the engine's
per-step overhead: scheduling, messages, the thread hand-off). They are
immune to what other tenants of the machine do between the run and the
baselines.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trioserve.runners.steplog import STEP_LOG_ENV, StepRecord


@contextmanager
def step_log_env(base: str | Path) -> Iterator[None]:
    """Set ``TRIOSERVE_STEP_LOG`` for the processes started inside (they
    inherit it), and restore the environment after."""
    old = os.environ.get(STEP_LOG_ENV)
    os.environ[STEP_LOG_ENV] = str(base)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(STEP_LOG_ENV, None)
        else:
            os.environ[STEP_LOG_ENV] = old


def weighted_median(values: list[tuple[float, int]]) -> float:
    """The median of each ``value`` counted ``weight`` times; NaN when empty."""
    ordered = sorted(v for v in values if v[1] > 0)
    half, seen = sum(w for _, w in ordered) / 2, 0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return math.nan


def in_run_figures(steps: list[StepRecord], start_s: float, end_s: float) -> dict[str, Any] | None:
    """Figures of the steps that started inside ``[start_s, end_s]`` (the
    measured run); None when there are none (no step log: the fake runner,
    or a server on another machine)."""
    inside = [s for s in steps if start_s <= s.start_s <= end_s]
    if not inside:
        return None
    gaps = [b.start_s - a.end_s for a, b in itertools.pairwise(inside)]
    busy = sum(s.seconds for s in inside)
    return {
        "num_steps": len(inside),
        "model_busy_s": busy,
        "model_busy_fraction": busy / (end_s - start_s),
        # Each step's time once per inter-token gap it ended: the ITL p50 with zero overhead.
        "itl_p50_s": weighted_median([(s.seconds, s.num_gaps) for s in inside]),
        "idle_between_steps_p50_s": sorted(gaps)[len(gaps) // 2] if gaps else math.nan,
        "idle_between_steps_mean_s": sum(gaps) / len(gaps) if gaps else math.nan,
    }
