"""Chrome trace files (the JSON that Perfetto and chrome://tracing load),
written without torch: the engine core's spans of its step loop, and the
fake runner's steps. A worker of the transformers runner writes
``torch.profiler``'s own trace instead (``gpu/profiler.py``).

One recording is named by its session (``StartProfile.session``); its files
are ``<profiler_dir>/trioserve-<session>-engine-<i>-core.trace.json`` for the
engine core and ``...-engine-<i>-rank-<r>.trace.json`` for each worker.

Invariants: a span is one complete event (``"ph": "X"``, start and duration
in microseconds of the wall clock); at most ``MAX_EVENTS`` are kept, and
those past it are counted, not kept; a file appears whole or not at all
(written beside, then renamed over).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator

MAX_EVENTS = 1_000_000  # spans kept in one recording (a few hundred bytes each)
_SESSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")


def check_session(session: str) -> str:
    """``session``, or a ``ValueError`` when it is not letters, digits and dashes (it names files)."""
    if not _SESSION.fullmatch(session):
        raise ValueError(f"session: {session[:80]!r} must be 1 to 64 letters, digits and dashes")
    return session


def trace_prefix(directory: str, session: str, engine_index: int) -> str:
    """The start of every trace file's path of engine ``engine_index`` in recording ``session``."""
    return os.path.join(directory, f"trioserve-{check_session(session)}-engine-{engine_index}")


def worker_trace_path(prefix: str, rank: int) -> str:
    return f"{prefix}-rank-{rank}.trace.json"


def core_trace_path(prefix: str) -> str:
    return f"{prefix}-core.trace.json"


class SpanTrace:
    """Spans of one process, kept in memory until ``write``. Spans may be
    recorded from any thread (each gets its thread's id)."""

    def __init__(self, process_name: str, *, limit: int = MAX_EVENTS) -> None:
        self.process_name = process_name
        self.limit = limit
        self.events: list[dict[str, object]] = []
        self.num_dropped = 0
        self._pid = os.getpid()

    @contextlib.contextmanager
    def span(self, name: str, step: int | None = None) -> Iterator[None]:
        """Record the time the ``with`` block takes as span ``name`` (of step ``step``, if given)."""
        start_us = time.time_ns() / 1000
        began = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, start_us, (time.perf_counter_ns() - began) / 1000, step)

    def add(self, name: str, start_us: float, duration_us: float, step: int | None = None) -> None:
        if len(self.events) >= self.limit:
            self.num_dropped += 1
            return
        event: dict[str, object] = {
            "name": name, "ph": "X", "ts": start_us, "dur": duration_us, "pid": self._pid,
            "tid": threading.get_ident() & 0xFFFFFFFF, "cat": "trioserve",
        }  # fmt: skip
        if step is not None:
            event["args"] = {"step": step}
        self.events.append(event)

    def write(self, path: str) -> str:
        """Write the trace to ``path`` (whole, or not at all); ``path``."""
        meta: list[dict[str, object]] = [
            {"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": self.process_name}},
        ]
        document = {
            "traceEvents": meta + self.events,
            "displayTimeUnit": "ms",
            "otherData": {"dropped_spans": self.num_dropped},
        }
        partial = f"{path}.partial"
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(document, file)
        os.replace(partial, path)
        return path
