"""``Engine``'s operator calls: ``scale`` (elastic data parallelism,
``frontend/engines/scaling.py``), and ``start_profile`` and ``stop_profile``
(profiling, with ``EngineConfig.profiler_dir``; the engine core's side is
``nurseries/engine_core/control.py``, the files ``runners/trace.py`` and
``gpu/profiler.py``).

A recording runs on every engine core that is up when it starts (one that
restarts meanwhile comes back without one, and its traces are lost with it).
Its files are named by a session stamp of the front-end's, so that the
traces of one recording sort together.
"""

from __future__ import annotations

import itertools
import os
import time

from trioserve.errors import ControlCallError
from trioserve.frontend.engines.group import EngineGroup
from trioserve.rpc import ControlCall, ControlReply, StartProfile, StopProfile, TraceFile

_sessions = itertools.count()  # within one second, in one process
DEFAULT_DRAIN_TIMEOUT_S = 120.0  # vLLM's /scale_elastic_ep default


class ScaleCalls:
    """``Engine``'s scaling (``Engine`` supplies its group)."""

    _group: EngineGroup

    async def scale(self, data_parallel_size: int, *, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Grow or shrink the engine cores to ``data_parallel_size`` while
        serving; return once done. New engine cores take requests as soon
        as each is ready; departing ones take none from the start, and their
        requests run to their end, for at most ``drain_timeout_s`` (then
        they end with ``EngineDeadError``), before they are stopped. No
        request is lost. Raises ``InvalidRequestError`` (a size below 1 or
        above 64; engines on other hosts or several API servers) or
        ``ControlCallError`` (a scale under way; new engines that could not
        start), and then nothing changed. If cancelled, the scale goes on."""
        await self._group.scaling.scale(data_parallel_size, drain_timeout_s)

    @property
    def is_scaling(self) -> bool:
        """A scale is under way."""
        return self._group.scaling.under_way


class ProfileCalls:
    """``Engine``'s profiling calls (``Engine`` supplies ``_control`` and its group)."""

    _group: EngineGroup

    async def _control(
        self, call: ControlCall, timeout_s: float | None, on_workers: bool = False
    ) -> list[ControlReply]:
        raise NotImplementedError

    def _check_profiling(self) -> None:
        if self._group.config.profiler_dir is None:
            raise ControlCallError("profiling is off: start the engine with --profiler-dir DIR (profiler_dir)")

    async def start_profile(self, *, timeout_s: float | None = None) -> None:
        """Record a profile from now on: each worker a ``torch.profiler``
        trace of its steps, each engine core the spans of its step loop
        (schedule, send, wait, postprocess). Raises ``ControlCallError`` when
        profiling is off (no ``profiler_dir``) or a recording already runs."""
        self._check_profiling()
        session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_sessions)}"
        await self._control(StartProfile(session=session), timeout_s, on_workers=True)

    async def stop_profile(self, *, timeout_s: float | None = None) -> list[str]:
        """Stop the recording and write its traces to ``profiler_dir`` (Chrome
        trace JSON, which Perfetto loads): one per engine core and rank
        (``trioserve-<session>-engine-<i>-rank-<r>.trace.json``) and one of
        each engine core's own spans (``...-engine-<i>-core.trace.json``). The
        paths written, by engine index. Raises ``ControlCallError`` when
        profiling is off or no recording runs."""
        self._check_profiling()
        replies = await self._control(StopProfile(), timeout_s, on_workers=True)
        return [r.path for reply in replies for r in reply.results if isinstance(r, TraceFile) and r.path]
