"""The data-parallel coordinator: the picture of every engine core's load,
and the choice of the engine for each new request.

``LoadPicture`` is plain logic (no I/O). An engine's requests: with one
front-end, those it has in flight there (exact and immediate; a report lags
a burst by up to ``LOAD_REPORT_INTERVAL_S`` and still counts requests that
have finished since); with several front-ends sharing the engines, what the
engine last reported (waiting and running) plus the requests sent to it
since, or this front-end's own count if that is more. Of those, the ones
beyond its ``max_num_seqs``, or that it reported waiting (for KV blocks),
wait; the rest run. The score is ``4 x waiting + running``: a request that
waits costs its client more than one more in the batch (it has no token
yet). The least score wins; ties go in rotation, so a uniform load spreads
evenly.

``Coordinator`` is the actor that owns the picture: engine clients hand it
their load reports through a bounded inbox (a full inbox drops a report; the
next one supersedes it), and the engine group asks it which engine gets the
next request. It lives as long as the engines (the engine group runs it
beside them), and a fault in it is a fault of the tree.

Invariants: scores only ever come from the last report of each engine and
the requests sent since; an engine that restarts starts again from zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from trioserve.core import waves
from trioserve.messages import LoadReport, WaveNotice

INBOX_SIZE = 256  # load reports waiting for the coordinator
WAITING_WEIGHT = 4  # a waiting request counts this many times a running one


class LoadPicture:
    """Each engine's load, as last reported, and the requests sent since."""

    def __init__(self, num_engines: int, max_running: int = 2**31, *, shared: bool = False) -> None:
        self._max_running = max_running  # an engine's max_num_seqs
        self._shared = shared  # other front-ends send to these engines too
        self._loads = [LoadReport(num_waiting=0, num_running=0) for _ in range(num_engines)]
        self._sent = [0] * num_engines
        self._next = 0  # where the rotation among equal scores starts

    @property
    def num_engines(self) -> int:
        return len(self._loads)

    def resize(self, num_engines: int) -> None:
        """The group grew or shrank (``frontend/engines/scaling.py``): a new
        engine starts from no load; a removed one's load is forgotten."""
        del self._loads[num_engines:], self._sent[num_engines:]
        while len(self._loads) < num_engines:
            self._loads.append(LoadReport(num_waiting=0, num_running=0))
            self._sent.append(0)
        self._next %= num_engines

    def report(self, engine: int, load: LoadReport) -> None:
        self._loads[engine] = load
        self._sent[engine] = 0

    def forget(self, engine: int) -> None:
        """The engine restarted: nothing of its old load holds."""
        self.report(engine, LoadReport(num_waiting=0, num_running=0))

    def score(self, engine: int, in_flight: int = 0) -> int:
        """``engine``'s score, given the requests this front-end has in flight there."""
        load = self._loads[engine]
        total = in_flight
        if self._shared:
            total = max(load.num_waiting + load.num_running + self._sent[engine], in_flight)
        waiting = max(total - self._max_running, min(load.num_waiting, total))
        return WAITING_WEIGHT * waiting + (total - waiting)

    def choose(self, candidates: Sequence[int], in_flight: Sequence[int] = ()) -> int:
        """The candidate with the least score (ties in rotation); counts a
        request as sent to it. ``in_flight``: this front-end's requests in
        flight at each engine, by engine index."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate engine")
        n = self.num_engines
        held = list(in_flight) or [0] * n
        ordered = sorted(candidates, key=lambda e: (self.score(e, held[e]), (e - self._next) % n))
        chosen = ordered[0]
        self._sent[chosen] += 1
        self._next = (chosen + 1) % n
        return chosen


@dataclass(frozen=True)
class LoadEvent:
    engine: int
    load: LoadReport | None  # None: the engine restarted


class Coordinator:
    """The actor that keeps the ``LoadPicture``. Feed it with
    ``report_nowait`` (from any task: never blocks); ask it with ``choose``.

    In lockstep it also keeps the request waves (``core/waves.py``): ``route``
    stamps each new request and, when the engines are paused, has
    ``broadcast`` tell the others to start; ``wave_notice`` takes the
    engines' notices. These are synchronous: the wave state changes only
    between two awaits of the Trio thread, so a stamp and the notices it
    races with are always seen in one order."""

    def __init__(
        self,
        num_engines: int,
        max_running: int = 2**31,
        *,
        broadcast: Callable[[waves.StartWave], None] | None = None,
        shared: bool = False,
    ) -> None:
        self.picture = LoadPicture(num_engines, max_running, shared=shared)
        self._broadcast = broadcast
        self.waves = waves.CoordinatorWaves() if broadcast is not None else None
        self._send, self._receive = trio.open_memory_channel[LoadEvent](INBOX_SIZE)
        self.num_dropped = 0  # reports dropped because the inbox was full

    def report_nowait(self, engine: int, load: LoadReport | None) -> None:
        """Hand over a load report (None: the engine restarted). Never blocks:
        with the inbox full, it is dropped (a newer one will come)."""
        try:
            self._send.send_nowait(LoadEvent(engine, load))
        except trio.WouldBlock:
            self.num_dropped += 1

    def choose(self, candidates: Sequence[int], in_flight: Sequence[int] = ()) -> int:
        return self.picture.choose(candidates, in_flight)

    def reset_waves(self) -> None:
        """The engines restarted together: they are paused, and the next wave
        is numbered after the last (a new engine core catches up with the
        first request or ``StartWave`` it gets)."""
        if self.waves is not None:
            self.waves.new_generation()

    def route(self, engine: int) -> int:
        """The wave to stamp a request for ``engine`` with (0 out of lockstep);
        when the engines are paused, the others are told to start it."""
        if self.waves is None or self._broadcast is None:
            return 0
        stamp, start = self.waves.route(engine)
        if start is not None:
            self._broadcast(start)
        return stamp

    def wave_notice(self, notice: WaveNotice) -> None:
        """An engine's wave notice: a wave ended, or one must start on the others."""
        if self.waves is None or self._broadcast is None:
            return
        if notice.kind == "complete":
            self.waves.wave_complete(waves.WaveComplete(notice.wave))
            return
        start = self.waves.wave_start_requested(waves.WaveStartRequested(notice.wave, notice.engine))
        if start is not None:
            self._broadcast(start)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply load reports as they come, until cancelled (nothing is left behind)."""
        task_status.started()
        async for event in self._receive:
            if event.engine >= self.picture.num_engines:
                continue  # from an engine removed since (a scale-down)
            if event.load is None:
                self.picture.forget(event.engine)
            else:
                self.picture.report(event.engine, event.load)
