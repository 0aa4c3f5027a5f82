"""The request-wave state machines (core/waves.py) in a simulated cluster:
engines and a coordinator exchanging their notices in any order hypothesis
picks, requests arriving at any engine with current or stale wave stamps,
work of any length, and every step a collective that completes only once
every engine has joined it (as the all-reduce of lockstep mode does).

Checked: no deadlock (whenever nothing else can happen, no engine waits in
a collective), every request finishes, wave numbers never go back, and the
engines leave every wave at the same step having run the same number of
steps in it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.core.waves import CoordinatorWaves, EngineWaves, StartWave, WaveComplete, WaveStartRequested

MAX_ACTIONS = 4000


@dataclass
class Engine:
    waves: EngineWaves
    inbox: deque[object] = field(default_factory=deque)  # StartWave, or (stamp, work) requests
    work: deque[int] = field(default_factory=deque)  # steps left, per request
    in_collective: bool = False  # joined the current step's collective, waiting for the others
    steps: int = 0  # steps completed (all engines complete them together)
    finished_waves: list[tuple[int, int]] = field(default_factory=list)  # (wave, steps in it)
    waves_seen: list[int] = field(default_factory=list)


class Cluster:
    def __init__(self, num_engines: int, sync_every: int) -> None:
        self.engines = [Engine(EngineWaves(i, sync_every=sync_every)) for i in range(num_engines)]
        self.coordinator = CoordinatorWaves()
        self.to_coordinator: deque[WaveComplete | WaveStartRequested] = deque()
        self.coordinator_waves: list[int] = [0]
        self.num_requests = 0
        self.num_finished = 0

    # --- actions -------------------------------------------------------------

    def arrive(self, engine: int, work: int, stale: bool) -> None:
        """The front-end routes a request through the coordinator (a
        ``stale`` stamp is one wave behind, as another front-end's could be)."""
        stamp, start = self.coordinator.route(engine)
        if stale and stamp > 0:
            stamp -= 1
        self.engines[engine].inbox.append((stamp, work))
        if start is not None:
            for other in self.engines:
                if other.waves.engine != start.exclude:
                    other.inbox.append(start)
        self.num_requests += 1

    def enabled(self) -> list[tuple[str, int]]:
        actions: list[tuple[str, int]] = []
        if self.to_coordinator:
            actions.append(("coordinator", 0))
        for i, e in enumerate(self.engines):
            if e.in_collective:
                continue
            if e.inbox:
                actions.append(("deliver", i))
            if e.waves.should_step(bool(e.work)):
                actions.append(("join", i))
        return actions

    def do(self, action: str, i: int) -> None:
        if action == "coordinator":
            msg = self.to_coordinator.popleft()
            if isinstance(msg, WaveComplete):
                self.coordinator.wave_complete(msg)
            else:
                start = self.coordinator.wave_start_requested(msg)
                for other in self.engines if start is not None else []:
                    if other.waves.engine != start.exclude:
                        other.inbox.append(start)
            self.coordinator_waves.append(self.coordinator.wave)
        elif action == "deliver":
            self._deliver(self.engines[i])
        else:
            self.engines[i].in_collective = True
            if all(e.in_collective for e in self.engines):
                self._complete_step()

    def _deliver(self, e: Engine) -> None:
        msg = e.inbox.popleft()
        if isinstance(msg, StartWave):
            e.waves.start_wave(msg)
        else:
            stamp, work = msg
            notice = e.waves.add_request(stamp)
            e.work.append(work)
            if notice is not None:
                self.to_coordinator.append(notice)
        e.waves_seen.append(e.waves.wave)

    def _complete_step(self) -> None:
        """Every engine joined: the collective's result is whether any has work."""
        for e in self.engines:
            if e.work:  # a real step: the oldest request makes progress
                e.work[0] -= 1
                if e.work[0] == 0:
                    e.work.popleft()
                    self.num_finished += 1
        any_unfinished = any(e.work for e in self.engines)
        for e in self.engines:
            e.in_collective = False
            e.steps += 1
            wave, steps_in_wave = e.waves.wave, e.waves.steps_in_wave + 1
            notice = e.waves.stepped(any_unfinished)
            if not e.waves.running:
                e.finished_waves.append((wave, steps_in_wave))
            if notice is not None:
                self.to_coordinator.append(notice)
            e.waves_seen.append(e.waves.wave)

    # --- checks ----------------------------------------------------------------

    def check(self) -> None:
        for e in self.engines:
            assert e.waves_seen == sorted(e.waves_seen), f"engine {e.waves.engine}'s wave went back"
        assert self.coordinator_waves == sorted(self.coordinator_waves), "the coordinator's wave went back"
        assert len({e.steps for e in self.engines}) == 1, "engines ran different numbers of steps"

    def check_quiet(self) -> None:
        """Nothing can happen any more: nobody waits in a collective, all
        work is done, and every engine left every wave at the same step."""
        waiting = [e.waves.engine for e in self.engines if e.in_collective]
        assert not waiting, f"deadlock: engines {waiting} wait in a collective the others never join"
        assert self.num_finished == self.num_requests, "a request never finished"
        first = self.engines[0].finished_waves
        for e in self.engines[1:]:
            assert e.finished_waves == first, "the engines left the waves at different steps"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, bool, int]]]:
    num_engines = draw(st.integers(2, 3))
    sync_every = draw(st.sampled_from([1, 2, 4]))
    arrivals = draw(
        st.lists(
            st.tuples(
                st.integers(0, num_engines - 1),  # engine
                st.integers(1, 6),  # steps of work
                st.booleans(),  # stale stamp
                st.integers(0, 40),  # actions before it arrives
            ),
            min_size=1,
            max_size=12,
        )
    )
    return num_engines, sync_every, arrivals


@settings(max_examples=400, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_waves_never_deadlock_and_every_engine_steps_alike(scenario, rnd) -> None:
    num_engines, sync_every, arrivals = scenario
    cluster = Cluster(num_engines, sync_every)
    pending = deque(arrivals)
    for _ in range(MAX_ACTIONS):
        if pending and pending[0][3] <= 0:
            engine, work, stale, _ = pending.popleft()
            cluster.arrive(engine, work, stale)
            continue
        if pending:
            pending[0] = (*pending[0][:3], pending[0][3] - 1)
        actions = cluster.enabled()
        if not actions:
            if pending:
                continue  # idle until the next request arrives
            break
        cluster.do(*rnd.choice(actions))
        cluster.check()
    else:
        raise AssertionError("the cluster never went quiet (livelock?)")
    cluster.check_quiet()


def test_a_request_for_a_finished_wave_wakes_the_other_engines():
    a, b = EngineWaves(0, sync_every=1), EngineWaves(1, sync_every=1)
    coordinator = CoordinatorWaves()
    stamp, start = coordinator.route(0)
    assert (stamp, start) == (0, StartWave(0, exclude=0))
    a.add_request(stamp)
    b.start_wave(start)
    done = a.stepped(any_unfinished=False)  # wave 0 ends at its first sync step
    b.stepped(any_unfinished=False)
    assert done == WaveComplete(0) and (a.wave, a.running, b.wave, b.running) == (1, False, 1, False)
    # The coordinator has not heard yet: it stamps the next request with wave 0.
    stamp, start = coordinator.route(1)
    assert (stamp, start) == (0, None)
    notice = b.add_request(stamp)
    assert notice == WaveStartRequested(1, engine=1)
    coordinator.wave_complete(done)  # arrives late: nothing to undo
    start = coordinator.wave_start_requested(notice)
    assert start == StartWave(1, exclude=1)
    a.start_wave(start)
    assert a.running and a.wave == b.wave == coordinator.wave == 1


def test_a_late_start_message_is_ignored():
    engine = EngineWaves(1, sync_every=1)
    engine.start_wave(StartWave(0, exclude=None))
    engine.stepped(any_unfinished=False)  # wave 0 over
    engine.start_wave(StartWave(0, exclude=None))  # a duplicate, late
    assert (engine.wave, engine.running) == (1, False)


def test_a_new_generation_starts_paused_at_the_next_wave_so_the_number_never_goes_back():
    coordinator = CoordinatorWaves()
    stamp, start = coordinator.route(0)
    assert (stamp, start) == (0, StartWave(0, exclude=0))
    coordinator.wave_complete(WaveComplete(0))
    coordinator.route(1)
    assert (coordinator.wave, coordinator.running) == (1, True)
    coordinator.new_generation()  # the engines restarted together (a death, or a scale) in wave 1
    assert (coordinator.wave, coordinator.running) == (2, False)
    coordinator.wave_complete(WaveComplete(1))  # a late notice of the old generation's wave: ignored
    assert coordinator.wave == 2
    stamp, start = coordinator.route(1)  # the new generation's first request starts wave 2 everywhere
    assert (stamp, start) == (2, StartWave(2, exclude=1))
    engine = EngineWaves(0)  # a new engine core starts at 0 and catches up
    engine.start_wave(StartWave(2, exclude=1))
    assert (engine.wave, engine.running) == (2, True)
