"""Request waves: how engine cores in lockstep (data parallel) start and
stop together. Two state machines, no I/O: one per engine core, one in the
coordinator. The actors only move their notices.

In lockstep, every step of every engine core takes part in one collective
across the engines (an all-reduce of "has unfinished requests"), so they
must all step, or none: while any engine has work, every engine steps, the
idle ones with dummy steps. A *wave* is such a stretch of steps. Every
``sync_every`` steps the collective's result is used: when no engine has an
unfinished request, the wave ends, at the same step on every engine (they
all saw the same result), and they pause; the wave number goes up by one.

A request starts the next wave. The coordinator stamps each new request with
the wave it believes current; when it believes the engines paused, it tells
every other engine to start (``StartWave``) as it sends the request. An
engine that gets a request stamped with a wave it has already finished
(the coordinator had not heard yet) asks the coordinator to start the wave
it is in (``WaveStartRequested``); the coordinator then tells the others. A
``StartWave`` that arrives late (for a wave already started, or finished) is
ignored. Engine 0 tells the coordinator when a wave ends (``WaveComplete``).

Invariants: a wave number never goes back, on any engine or in the
coordinator; an engine steps exactly when it is running or has work; the
engines leave a wave at the same step, so every engine runs the same number
of steps in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StartWave:
    """Coordinator -> engines: run wave ``wave``; ``exclude`` already knows."""

    wave: int
    exclude: int | None


@dataclass(frozen=True)
class WaveStartRequested:
    """Engine -> coordinator: I got a request for a finished wave; start ``wave``."""

    wave: int
    engine: int


@dataclass(frozen=True)
class WaveComplete:
    """Engine 0 -> coordinator: wave ``wave`` ended; the engines paused."""

    wave: int


class EngineWaves:
    """One engine core's side."""

    def __init__(self, engine: int, *, sync_every: int = 32) -> None:
        if sync_every < 1:
            raise ValueError("sync_every: must be >= 1")
        self.engine = engine
        self.sync_every = sync_every
        self.wave = 0
        self.running = False  # in a wave: step, with dummy steps when there is no work
        self.steps_in_wave = 0

    def add_request(self, request_wave: int) -> WaveStartRequested | None:
        """A request stamped with ``request_wave`` arrived. It runs now; the
        coordinator must be told when it was meant for a finished wave."""
        notice = None
        if request_wave > self.wave:
            self.wave = request_wave  # the coordinator is ahead of us: catch up
        elif request_wave < self.wave and not self.running:
            notice = WaveStartRequested(self.wave, self.engine)
        self.running = True
        return notice

    def start_wave(self, msg: StartWave) -> None:
        if msg.exclude != self.engine and msg.wave >= self.wave:
            self.wave = msg.wave
            self.running = True

    def should_step(self, has_work: bool) -> bool:
        """Step now (a dummy step when there is no ``has_work``)?"""
        return self.running or has_work

    def is_sync_step(self) -> bool:
        """Is the coming step one whose collective result decides the wave?"""
        return (self.steps_in_wave + 1) % self.sync_every == 0

    def stepped(self, any_unfinished: bool) -> WaveComplete | None:
        """A step (and its collective) ran; ``any_unfinished`` is the
        collective's result, whether any engine still has work. Ends the wave
        on a sync step with none; engine 0 then reports it."""
        self.running = True
        self.steps_in_wave += 1
        if self.steps_in_wave % self.sync_every != 0 or any_unfinished:
            return None
        finished = self.wave
        self.wave += 1
        self.running = False
        self.steps_in_wave = 0
        return WaveComplete(finished) if self.engine == 0 else None


class CoordinatorWaves:
    """The coordinator's side: the wave it believes current, and whether the
    engines are in it."""

    def __init__(self) -> None:
        self.wave = 0
        self.running = False

    def route(self, engine: int) -> tuple[int, StartWave | None]:
        """A new request goes to ``engine``: the wave to stamp it with, and
        the ``StartWave`` for the other engines when they are paused."""
        if self.running:
            return self.wave, None
        self.running = True
        return self.wave, StartWave(self.wave, exclude=engine)

    def new_generation(self) -> None:
        """The engines start again together (one died, or the group re-forms
        at a new size): they start paused, and the next wave is numbered
        after the last one, so the wave number never goes back."""
        self.wave += 1
        self.running = False

    def wave_complete(self, msg: WaveComplete) -> None:
        if msg.wave >= self.wave:
            self.wave = msg.wave + 1
            self.running = False

    def wave_start_requested(self, msg: WaveStartRequested) -> StartWave | None:
        """An engine got a request for a finished wave: start its wave on the others."""
        if msg.wave > self.wave or (msg.wave == self.wave and not self.running):
            self.wave = msg.wave
            self.running = True
            return StartWave(msg.wave, exclude=msg.engine)
        return None
