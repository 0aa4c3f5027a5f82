"""The step log: a model runner's own timing of each step, for benchmarks.

With ``TRIOSERVE_STEP_LOG=PATH`` in its environment, a model runner of rank
r appends one line per ``execute()`` to ``PATH.r``: when the step started and
ended (``time.perf_counter``, which on Linux is the system-wide monotonic
clock, so it compares with the bench client's timestamps), how many tokens
and sequences it ran, how many tokens it sampled, and how many of those
were a request's first output token (the rest each end an inter-token gap).
This module is the file format only (the runner writes with ``format_step``,
the benchmark reads with ``read_step_log``); ``bench.steps`` turns the lines
into figures. It imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STEP_LOG_ENV = "TRIOSERVE_STEP_LOG"


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    end_s: float
    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_first: int  # sampled tokens that were a request's first output token

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def num_gaps(self) -> int:
        """Inter-token gaps this step ended: its sampled tokens but first ones."""
        return self.num_sampled - self.num_first


def step_log_path(base: str, rank: int) -> str:
    return f"{base}.{rank}"


def format_step(record: StepRecord) -> str:
    r = record
    return f"{r.start_s:.6f} {r.end_s:.6f} {r.num_tokens} {r.num_seqs} {r.num_sampled} {r.num_first}\n"


def read_step_log(path: str | Path) -> list[StepRecord]:
    """The records in a step log; [] when there is none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 6:  # a line cut short by a killed worker is skipped
            start, end, *counts = fields
            records.append(StepRecord(float(start), float(end), *(int(c) for c in counts)))
    return records
