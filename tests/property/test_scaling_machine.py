"""Elastic data parallelism under random scale-ups, scale-downs, kills and requests: a hypothesis state machine
over a real engine group (supervisors, coordinator, routing, scaling) whose engine cores are simulated in the
test's own process, on Trio's virtual clock (the supervisor's ``client_factory`` seam; no process starts).

Trio runs in the main thread with a ``MockClock`` that moves only when a rule says (``advance``); the machine
runs in a worker thread and calls in with ``trio.from_thread.run``. A simulated engine core (``SimClient``) is
ready after ``START_S``, finishes each request after ``REQUEST_S`` with the fake runner's tokens, and in
lockstep keeps its request waves with the engine cores' own state machine (``core/waves.py``), ending a wave
when no engine of its generation has a request (as the real collective's sync step would).

Rules: send requests; scale to 1..3 engines (one scale at a time: a scale asked while one runs must be
refused with ``ControlCallError``, changing nothing); kill an engine core (it restarts); let time pass.
Checked after every rule: no request was routed to a departing engine (checked at the moment routing chose
it); engine i's supervisor is the i-th, and the coordinator's picture has one entry per engine; in lockstep
the coordinator's wave number never went back, nor any engine core's within its life. At the end (every
scale done, every request ended): every request ended, with the fake runner's tokens, or with
``EngineDeadError`` only if an engine core was killed (the drain timeout is far longer than a request, so
none ends by a scale); the group's size is the last scale's.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import trio
import trio.testing
from helpers.fakes import fake_tokens, make_fake_config
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import trioserve
from trioserve import SamplingParams
from trioserve.api import _open
from trioserve.core.waves import EngineWaves, StartWave, WaveComplete
from trioserve.errors import ControlCallError, EngineDeadError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.group import EngineGroup
from trioserve.frontend.engines.local import LocalProcessStrategy
from trioserve.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    ModelInfo,
    TokenOutput,
    WaveNotice,
)
from trioserve.messages import StartWave as StartWaveMsg

T = TypeVar("T")
START_S = 0.3  # a simulated engine core's start-up
REQUEST_S = 0.4  # ... and each request's time in it
DRAIN_TIMEOUT_S = 30.0  # far beyond REQUEST_S: no request ends by a scale
TICK_S = 0.05
MAX_TOKENS = 3
INFO = EngineInfo(
    model=ModelInfo(vocab_size=259, max_model_len=64, eos_token_ids=[2]),
    num_kv_blocks=64, block_size=4, max_model_len=64, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class World:
    """Every simulated engine core made, and what the lockstep ones share."""

    def __init__(self) -> None:
        self.clients: list[SimClient] = []
        self.wave_went_back: list[str] = []

    def factory(self, group: EngineGroup, config: Any, index: int, on_dead: Callable[..., None]) -> SimClient:
        client = SimClient(self, group, config, index, on_dead)
        self.clients.append(client)
        return client

    def generation_idle(self, generation: int) -> bool:
        return not any(c.held for c in self.clients if c.generation == generation and c.dead is None)


class SimClient(EngineCoreClient):
    """An engine core's life with no process (see the module docstring)."""

    def __init__(self, world: World, group: EngineGroup, config: Any, index: int, on_dead: Callable[..., None]):
        super().__init__(config, index, LocalProcessStrategy(), on_dead=on_dead)  # never run: no process
        self.world = world
        self.group = group
        self.generation = -1  # lockstep: set once the group placed it
        self.waves: EngineWaves | None = None
        self.held: set[str] = set()  # requests it runs

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        if self.data_parallel is not None:
            self.generation = self.group.generation
            self.waves = EngineWaves(self.data_parallel.rank, sync_every=1)
        await trio.sleep(START_S)
        self.info = INFO
        task_status.started(INFO)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve, nursery)
            await self.wait_dead()
            nursery.cancel_scope.cancel()

    def kill(self) -> None:
        self.die("killed by the test")

    async def _serve(self, nursery: trio.Nursery) -> None:
        decode = msgspec.msgpack.Decoder(EngineRequest).decode
        while True:
            msg = decode(await self._to_engine.get())
            if isinstance(msg, AddRequest):
                self.held.add(msg.request_id)
                if self.waves is not None and (notice := self.waves.add_request(msg.wave)) is not None:
                    self._tell(WaveNotice(kind="start_requested", wave=notice.wave, engine=notice.engine))
                nursery.start_soon(self._finish, msg)
            elif isinstance(msg, AbortRequests):
                self.held -= set(msg.request_ids)
            elif isinstance(msg, StartWaveMsg) and self.waves is not None:
                start = StartWave(msg.wave, msg.exclude)
                self._check_wave(lambda w, start=start: w.start_wave(start))

    async def _finish(self, msg: AddRequest) -> None:
        await trio.sleep(REQUEST_S)
        if msg.request_id not in self.held:
            return
        self.held.discard(msg.request_id)
        tokens = fake_tokens(msg.prompt_token_ids, msg.params.max_tokens or MAX_TOKENS)
        self._dispatch(EngineOutputs([TokenOutput(msg.request_id, tokens, finish_reason="length")]))
        if self.waves is not None and self.world.generation_idle(self.generation):
            # The sync step of a wave with no work left: every engine of the generation leaves it at once.
            for peer in self.world.clients:
                if peer.generation == self.generation and peer.dead is None and peer.waves and peer.waves.running:
                    peer._check_wave(lambda w: w.stepped(False))

    def _check_wave(self, change: Callable[[EngineWaves], Any]) -> None:
        assert self.waves is not None
        before = self.waves.wave
        done = change(self.waves)
        if self.waves.wave < before:
            self.world.wave_went_back.append(f"{self.name}: wave {before} -> {self.waves.wave}")
        if isinstance(done, WaveComplete):
            self._tell(WaveNotice(kind="complete", wave=done.wave, engine=0))

    def _tell(self, notice: WaveNotice) -> None:
        if self.on_wave is not None:
            self.on_wave(notice)


class Harness:
    """The Trio side of the machine: the engine, its requests, its scales."""

    def __init__(self, clock: trio.testing.MockClock, nursery: trio.Nursery, model: str) -> None:
        self.clock = clock
        self.nursery = nursery
        self.model = model
        self.engine: trioserve.Engine | None = None
        self.group: EngineGroup | None = None
        self.world = World()
        self._close = trio.Event()
        self._closed = trio.Event()
        self.outcomes: dict[int, object] = {}  # request -> its tokens, or the error it ended with
        self.misrouted: list[str] = []
        self.scales: list[object] = []  # each scale's outcome: None (done), or what it raised
        self.scaling = 0  # scales under way
        self.coordinator_waves: list[int] = []

    async def open(self, lockstep: bool) -> None:
        config = make_fake_config(
            self.model, data_parallel_lockstep=lockstep, restart_backoff_s=0.2, max_restarts=1000,
            restart_wait_s=600.0,
        )  # fmt: skip
        placed: list[EngineGroup] = []
        group = EngineGroup(config, client_factory=lambda *args: self.world.factory(placed[0], *args))
        placed.append(group)
        self.group = group
        self.nursery.start_soon(self._run, config, group)
        while self.engine is None:
            await self._tick()

    async def _run(self, config: Any, group: EngineGroup) -> None:
        async with _open(config, group) as engine:
            routed = group.route

            async def route(engine_index: int | None = None) -> tuple[EngineCoreClient, int]:
                client, wave = await routed(engine_index)
                supervisor = group.supervisors[client.engine_index]
                if supervisor.departing or supervisor.live_client() is not client:
                    self.misrouted.append(f"{client.name} (departing: {supervisor.departing})")
                return client, wave

            group.route = route  # type: ignore[method-assign]
            self.engine = engine
            await self._close.wait()
        self._closed.set()

    async def close(self) -> None:
        self._close.set()
        while not self._closed.is_set():
            await self._tick()

    async def _tick(self) -> None:
        self.clock.jump(TICK_S)
        await trio.testing.wait_all_tasks_blocked()
        if self.group is not None and self.group.coordinator.waves is not None:
            self.coordinator_waves.append(self.group.coordinator.waves.wave)

    async def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / TICK_S)):
            await self._tick()

    async def send(self, prompts: list[list[int]]) -> None:
        for prompt in prompts:
            self.nursery.start_soon(self._request, len(self.outcomes), prompt)
            self.outcomes[len(self.outcomes)] = "sent"
        await trio.testing.wait_all_tasks_blocked()

    async def _request(self, i: int, prompt: list[int]) -> None:
        assert self.engine is not None
        try:
            output = await self.engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS))
        except (EngineDeadError, ControlCallError) as exc:
            self.outcomes[i] = exc
            return
        self.outcomes[i] = (output.token_ids == fake_tokens(prompt, MAX_TOKENS)) or output.token_ids

    async def scale(self, size: int) -> bool:
        """Ask for a scale; False when refused at once (one is under way)."""
        assert self.engine is not None
        refused: list[BaseException] = []
        under_way = self.scaling > 0

        async def run() -> None:
            self.scaling += 1
            try:
                await self.engine.scale(size, drain_timeout_s=DRAIN_TIMEOUT_S)  # type: ignore[union-attr]
                self.scales.append(None)
            except ControlCallError as exc:
                refused.append(exc)
                self.scales.append(exc)
            finally:
                self.scaling -= 1

        self.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        if under_way:
            assert refused and "is under way" in str(refused[0]), refused
        return not refused

    async def kill(self, index: int) -> None:
        assert self.group is not None
        if index < len(self.group.supervisors) and (client := self.group.supervisors[index].live_client()):
            assert isinstance(client, SimClient)
            client.kill()
        await trio.testing.wait_all_tasks_blocked()


class ScalingMachine(RuleBasedStateMachine):
    harness: Harness
    call: Callable[..., Any]

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return type(self).call(fn, *args)

    @initialize(lockstep=st.booleans())
    def start(self, lockstep: bool) -> None:
        self.lockstep = lockstep
        self.killed: set[int] = set()  # id() of the lives killed
        self.size = 1
        self.run(self.harness.open, lockstep)

    @rule(prompts=st.lists(st.lists(st.integers(3, 250), min_size=1, max_size=4), min_size=1, max_size=4))
    def send(self, prompts: list[list[int]]) -> None:
        self.run(self.harness.send, prompts)

    @rule(size=st.integers(1, 3))
    def scale(self, size: int) -> None:
        group = self.harness.group
        assert group is not None
        event(f"scale {len(group.supervisors)} -> {size}{' (lockstep)' if self.lockstep else ''}")
        if self.run(self.harness.scale, size):
            self.size = size
        else:
            event("a scale refused: another ran")

    @rule(size=st.integers(1, 3), prompts=st.lists(st.lists(st.integers(3, 250), min_size=1, max_size=4), max_size=4))
    def scale_then_send(self, size: int, prompts: list[list[int]]) -> None:
        """Requests that arrive while a scale runs (its engines starting, or departing and draining)."""
        self.scale(size)
        self.send(prompts)

    @rule(index=st.integers(0, 2))
    def kill(self, index: int) -> None:
        group = self.harness.group
        assert group is not None
        if index < len(group.supervisors) and group.supervisors[index].departing:
            event("a departing engine killed")
        self.run(self.harness.kill, index)

    @rule(seconds=st.sampled_from([0.1, 0.3, 0.6, 1.5]))
    def advance(self, seconds: float) -> None:
        self.run(self.harness.advance, seconds)

    @invariant()
    def never_routed_to_a_departing_engine(self) -> None:
        assert self.harness.misrouted == []

    @invariant()
    def each_engine_has_its_place(self) -> None:
        group = self.harness.group
        assert group is not None
        assert [s.engine_index for s in group.supervisors] == list(range(len(group.supervisors)))
        assert group.coordinator.picture.num_engines == len(group.supervisors)

    @invariant()
    def waves_never_go_back(self) -> None:
        waves = self.harness.coordinator_waves
        assert waves == sorted(waves), "the coordinator's wave went back"
        assert self.harness.world.wave_went_back == []

    def teardown(self) -> None:
        harness = self.harness
        if harness.engine is None:
            return

        async def settle() -> None:
            for _ in range(2000):  # every scale done, every request ended (bounded: a hang fails below)
                if harness.scaling == 0 and "sent" not in harness.outcomes.values():
                    break
                await harness._tick()

        self.run(settle)
        hung = [i for i, o in harness.outcomes.items() if o == "sent"]
        assert not hung and harness.scaling == 0, f"requests that never ended: {hung}"
        killed_any = any(c.dead is not None and "killed by the test" in str(c.dead) for c in harness.world.clients)
        for i, outcome in harness.outcomes.items():
            if isinstance(outcome, BaseException):
                # Its engine core was killed (in lockstep, or a peer of it, and they restart together).
                assert isinstance(outcome, EngineDeadError) and killed_any, (i, outcome)
                assert "killed by the test" in str(outcome) or "restart together" in str(outcome), (i, outcome)
            else:
                assert outcome is True, (i, outcome)
        assert harness.group is not None and len(harness.group.supervisors) == self.size
        assert harness.engine.config.data_parallel_size == self.size
        # Every scale was done, or refused at once because another ran (no start failed here).
        assert all(s is None or "is under way" in str(s) for s in harness.scales), harness.scales
        self.run(harness.close)


SCALING_SETTINGS = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_scaling_loses_no_request_and_never_routes_to_a_departing_engine(tiny_model_dir):
    model = str(tiny_model_dir("llama"))

    clock = trio.testing.MockClock()  # moves only when the machine's rules say

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            class Machine(ScalingMachine):
                call = staticmethod(trio.from_thread.run)

                def __init__(self) -> None:
                    super().__init__()
                    self.harness = Harness(clock, nursery, model)

            await trio.to_thread.run_sync(
                functools.partial(run_state_machine_as_test, Machine, settings=SCALING_SETTINGS)
            )
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
