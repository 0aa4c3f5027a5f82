"""The periodic stats line (vLLM's logging stat logger): every
``log_stats_interval_s``, while the engine serves and something happened
since the last line, one INFO line on the logger ``trioserve.stats``:
tokens computed per second (prompts and generation, from the engine
cores), tokens generated per second (by requests that ended), requests
running and waiting, KV-cache use, and the prefix cache's hit rate over
the interval."""

from __future__ import annotations

import logging
import time

import trio

from trioserve.api import Engine
from trioserve.messages import EngineStats
from trioserve.server.metrics import ServerMetrics

log = logging.getLogger("trioserve.stats")


class StatsLine:
    """What the last line said, to compute the next one's rates."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._at = time.monotonic()
        self._computed = 0
        self._generated = 0
        self._queries = 0
        self._hits = 0

    def line(self, stats: EngineStats) -> str | None:
        """The line for ``stats``, or None when nothing happened since the last one."""
        now = time.monotonic()
        seconds = max(now - self._at, 1e-9)
        computed = max(0, stats.num_scheduled_tokens - self._computed)  # (an engine core restarted: from zero)
        generated = self._metrics.total_generation_tokens - self._generated
        queries = max(0, stats.prefix_cache_queries - self._queries)
        hits = max(0, stats.prefix_cache_hits - self._hits)
        self._at, self._computed, self._generated = (
            now,
            stats.num_scheduled_tokens,
            self._metrics.total_generation_tokens,
        )
        self._queries, self._hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if not (computed or generated or stats.num_running or stats.num_waiting):
            return None
        used = stats.num_total_blocks - stats.num_free_blocks
        usage = used / stats.num_total_blocks if stats.num_total_blocks else 0.0
        hit_rate = f"{hits / queries:.1%}" if queries else "-"
        return (
            f"tokens computed: {computed / seconds:.1f}/s, generated: {generated / seconds:.1f}/s, "
            f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {usage:.1%}, prefix cache hit rate: {hit_rate}"
        )


async def log_stats(engine: Engine, metrics: ServerMetrics, interval_s: float) -> None:
    """Log a stats line every ``interval_s`` while the engine serves (runs until cancelled)."""
    stats_line = StatsLine(metrics)
    while True:
        await trio.sleep(interval_s)
        if engine.health not in ("ready", "stalled"):
            continue
        with trio.move_on_after(interval_s):
            try:
                stats = await engine.stats()
            except Exception as exc:  # the engine died meanwhile: no line this time
                log.debug("no stats line: %s", exc)
                continue
            if (line := stats_line.line(stats)) is not None:
                log.info("%s", line)
