"""The supervisor's restart schedule, on Trio's virtual clock.

No process is started: the supervisor is given a fake engine-core client
(its ``client_factory`` seam) that is "ready" at once and dies when the test
says. Every time asserted is exact, because ``autojump_clock`` only moves
when every task is blocked.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import trio
import trio.testing

from trioserve import EngineConfig
from trioserve.errors import EngineDeadError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.local import LocalProcessStrategy
from trioserve.frontend.engines.supervisor import EngineSupervisor
from trioserve.messages import EngineInfo, ModelInfo
from trioserve.rpc import ControlCall, ControlReply, GenerationState, Pause, Resume, Sleep, WakeUp

INFO = EngineInfo(
    model=ModelInfo(vocab_size=259, max_model_len=64, eos_token_ids=[2]),
    num_kv_blocks=16, block_size=4, max_model_len=64, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class FakeClient(EngineCoreClient):
    """An engine-core life with no process: ready at once, dead on ``kill()``."""

    def __init__(self, config: EngineConfig, index: int, on_dead: Callable[[EngineCoreClient], None]) -> None:
        super().__init__(config, index, LocalProcessStrategy(), on_dead=on_dead)  # never run: no process
        self.started_at = trio.current_time()
        self._killed = trio.Event()

    def kill(self) -> None:
        self._killed.set()

    reports = INFO  # what this life says it loaded

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        self.info = self.reports
        task_status.started(self.reports)
        await self._killed.wait()
        self.die("killed by the test")


class Lives:
    """Every fake client the supervisor made, in order."""

    def __init__(
        self,
        *,
        controlled: bool = False,
        second_answers: int | None = None,
        reports: dict[int, EngineInfo] | None = None,
    ) -> None:
        self.clients: list[FakeClient] = []
        self._reports = reports or {}  # life (from 1) -> what it says it loaded, if not INFO
        self.changed = trio.Event()
        self._controlled = controlled  # lives that take control calls (ControlledClient)
        self._second_answers = second_answers  # ... of which the second answers only so many

    def factory(self, config: EngineConfig, index: int, on_dead: Callable[[EngineCoreClient], None]) -> FakeClient:
        client = ControlledClient(config, index, on_dead) if self._controlled else FakeClient(config, index, on_dead)
        if isinstance(client, ControlledClient) and len(self.clients) == 1:
            client.answers = self._second_answers
        self.clients.append(client)
        client.reports = self._reports.get(len(self.clients), INFO)
        self.changed.set()
        self.changed = trio.Event()
        return client

    async def next_life(self, count: int) -> FakeClient:
        while len(self.clients) < count:
            await self.changed.wait()
        return self.clients[count - 1]


def config(**changes: object) -> EngineConfig:
    options: dict[str, object] = {
        "model": "unused", "runner": "fake", "restart_backoff_s": 0.5,
        "restart_backoff_max_s": 3.0, "max_restarts": 3, "restart_window_s": 100.0,
    }  # fmt: skip
    options.update(changes)
    return EngineConfig(**options)  # type: ignore[arg-type]


async def test_restarts_back_off_doubling_up_to_the_cap_and_fail_past_the_budget(autojump_clock):
    lives = Lives()
    supervisor = EngineSupervisor(config(), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        assert (supervisor.health, trio.current_time()) == ("ready", 0.0)
        for life, backoff in enumerate([0.5, 1.0, 2.0], start=1):
            await trio.sleep(10.0)
            died_at = trio.current_time()
            (await lives.next_life(life)).kill()
            await trio.testing.wait_all_tasks_blocked()
            assert supervisor.health == "restarting"
            new = await lives.next_life(life + 1)
            await trio.testing.wait_all_tasks_blocked()
            assert new.started_at == died_at + backoff == trio.current_time()
            assert supervisor.health == "ready" and supervisor.num_restarts == life
        await trio.sleep(10.0)
        (await lives.next_life(4)).kill()  # the fourth death within the window: out of budget
        failure = await supervisor.wait_failed()
        assert trio.current_time() == 10 + 10.5 + 11 + 12 and supervisor.health == "failed"
        assert "died 4 time(s) within restart_window_s=100.0s (max_restarts=3)" in str(failure)
        nursery.cancel_scope.cancel()
    assert len(lives.clients) == 4


async def test_a_life_that_loaded_another_model_is_a_failed_start_naming_what_changed(autojump_clock, caplog):
    """Found: after the model directory was replaced, a restart served
    another model through the first one's tokenizer, health ``ready``."""
    other = msgspec.structs.replace(INFO, model=ModelInfo(vocab_size=49152, max_model_len=64, eos_token_ids=[2]))
    lives = Lives(reports={2: other})
    supervisor = EngineSupervisor(config(), client_factory=lives.factory)
    with trio.fail_after(100):  # virtual: without the check, no third life ever comes
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            (await lives.next_life(1)).kill()
            await lives.next_life(3)  # the second life's start failed: a death, and a third after its backoff
            await trio.testing.wait_all_tasks_blocked()
            assert supervisor.health == "ready" and supervisor.num_restarts == 2 and supervisor.info == INFO
            assert trio.current_time() == 0.5 + 1.0
            nursery.cancel_scope.cancel()
    assert any(
        "restart 1 failed: the model at 'unused' changed since the engine started (vocab_size 259 -> 49152)"
        in record.message
        for record in caplog.records
    )


async def test_the_backoff_stops_doubling_at_its_cap(autojump_clock):
    lives = Lives()
    supervisor = EngineSupervisor(config(max_restarts=10, restart_backoff_max_s=1.5), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        delays = []
        for life in range(1, 5):
            died_at = trio.current_time()
            (await lives.next_life(life)).kill()
            delays.append((await lives.next_life(life + 1)).started_at - died_at)
        assert delays == [0.5, 1.0, 1.5, 1.5]
        nursery.cancel_scope.cancel()


async def test_deaths_older_than_the_window_no_longer_count(autojump_clock):
    lives = Lives()
    supervisor = EngineSupervisor(config(max_restarts=1, restart_window_s=5.0), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        (await lives.next_life(1)).kill()  # t=0: first death, restarted at 0.5
        await lives.next_life(2)
        await trio.sleep(5.0)  # t=5.5: the first death is out of the window
        died_at = trio.current_time()
        (await lives.next_life(2)).kill()
        assert (await lives.next_life(3)).started_at == died_at + 0.5  # the backoff restarted too
        (await lives.next_life(3)).kill()  # two deaths within 5 s: out of budget
        await supervisor.wait_failed()
        assert supervisor.health == "failed"
        nursery.cancel_scope.cancel()


async def test_a_request_waits_for_a_restarting_engine_exactly_restart_wait_s(autojump_clock):
    lives = Lives()
    cfg = config(restart_backoff_s=30.0, restart_backoff_max_s=30.0, restart_wait_s=7.0)
    supervisor = EngineSupervisor(cfg, client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        (await lives.next_life(1)).kill()
        await trio.testing.wait_all_tasks_blocked()
        asked_at = trio.current_time()
        with pytest.raises(EngineDeadError, match=r"restart_wait_s=7\.0s"):
            await supervisor.ready_client()
        assert trio.current_time() == asked_at + 7.0
        nursery.cancel_scope.cancel()


async def test_a_request_waiting_for_a_restart_gets_the_new_engine_the_moment_it_is_ready(autojump_clock):
    lives = Lives()
    supervisor = EngineSupervisor(config(restart_backoff_s=2.0, restart_wait_s=60.0), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        (await lives.next_life(1)).kill()
        await trio.testing.wait_all_tasks_blocked()
        asked_at = trio.current_time()
        client = await supervisor.ready_client()
        assert client is lives.clients[1] and trio.current_time() == asked_at + 2.0
        nursery.cancel_scope.cancel()


class ControlledClient(FakeClient):
    """A fake life that takes control calls as an engine core would, and records them."""

    def __init__(self, config: EngineConfig, index: int, on_dead: Callable[[EngineCoreClient], None]) -> None:
        super().__init__(config, index, on_dead)
        self.calls: list[str] = []

    answers: int | None = None  # how many calls it answers; the later ones only its death does (EngineDeadError)

    async def control(self, call: ControlCall, timeout_s: float) -> ControlReply:
        self.check_alive()
        self.calls.append(type(call).__name__)
        if self.answers is not None and len(self.calls) > self.answers:
            await self.wait_dead()
            self.check_alive()
        paused = {Pause: True, Resume: False}.get(type(call), self.state.paused)
        level = call.level if isinstance(call, Sleep) else 0 if isinstance(call, WakeUp) else self.state.sleep_level
        self.state = GenerationState(paused=paused, sleep_level=level, holding=paused or level > 0)
        return ControlReply(call_id=0, state=self.state)


async def test_a_new_life_is_put_in_the_state_the_last_one_said_and_the_calls_asked_meanwhile(autojump_clock):
    lives = Lives(controlled=True)
    supervisor = EngineSupervisor(config(), client_factory=lives.factory)

    async def kill_and_wait(life: int) -> ControlledClient:
        lives.clients[life - 1].kill()
        client = await lives.next_life(life + 1)
        while supervisor.health in ("restarting", "starting"):
            await supervisor.wait_changed()
        assert isinstance(client, ControlledClient)
        return client

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        first = lives.clients[0]
        first.state = GenerationState(paused=True, holding=True)  # its last word: paused (by any front-end)
        lives.clients[0].kill()
        await lives.next_life(2)
        supervisor.remember(Resume())  # asked while it is down: the pause is not sent
        while supervisor.health in ("restarting", "starting"):
            await supervisor.wait_changed()
        second = lives.clients[1]
        assert isinstance(second, ControlledClient)
        assert (second.calls, supervisor.health) == ([], "ready")
        # Its last word: asleep; a pause asked while it is down; then both are sent to the next.
        second.state = GenerationState(sleep_level=2, holding=True)
        second.kill()
        await lives.next_life(3)
        supervisor.remember(Pause())
        while supervisor.health in ("restarting", "starting"):
            await supervisor.wait_changed()
        third = lives.clients[2]
        assert isinstance(third, ControlledClient)
        assert (third.calls, supervisor.health) == (["Sleep", "Pause"], "sleeping")
        assert third.state.sleep_level == 2
        # Killed while a pause it was asked has no answer yet: the next life is paused.
        await third.control(WakeUp(), 1.0)
        await third.control(Resume(), 1.0)
        third.asking.append(Pause())
        fourth = await kill_and_wait(3)
        assert (fourth.calls, supervisor.health) == (["Pause"], "paused")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("undo", [Resume(), WakeUp()])
async def test_a_life_that_dies_while_put_in_its_state_leaves_the_call_asked_meanwhile_last(autojump_clock, undo):
    """Found: a resume (wake-up) asked while the new life was being paused
    (put to sleep), then its death, left the next life paused (asleep) for
    good: the unanswered call was put back after the one that undid it. And
    the dead life was marked ready."""
    lives = Lives(controlled=True, second_answers=0)
    supervisor = EngineSupervisor(config(), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        paused = isinstance(undo, Resume)
        lives.clients[0].state = GenerationState(paused=paused, sleep_level=0 if paused else 1, holding=True)
        lives.clients[0].kill()
        second = await lives.next_life(2)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(second, ControlledClient) and second.calls == (["Pause"] if paused else ["Sleep"])
        supervisor.remember(undo)  # asked now: no engine core is live yet
        second.kill()
        await trio.testing.wait_all_tasks_blocked()
        assert supervisor.client is not second and supervisor.health == "restarting"
        third = await lives.next_life(3)
        while supervisor.health in ("restarting", "starting"):
            await supervisor.wait_changed()
        assert isinstance(third, ControlledClient)
        assert (third.calls, supervisor.health) == ([], "ready")
        nursery.cancel_scope.cancel()


async def test_a_life_that_dies_while_put_in_its_state_leaves_every_call_to_the_next(autojump_clock):
    """Found: a pause that the dying life had answered (before it died on the
    sleep) was lost: the next life was asleep but not paused."""
    lives = Lives(controlled=True, second_answers=1)
    supervisor = EngineSupervisor(config(), client_factory=lives.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        lives.clients[0].state = GenerationState(paused=True, sleep_level=2, holding=True)
        lives.clients[0].kill()
        second = await lives.next_life(2)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(second, ControlledClient) and second.calls == ["Pause", "Sleep"]
        second.kill()
        third = await lives.next_life(3)
        while supervisor.health in ("restarting", "starting"):
            await supervisor.wait_changed()
        assert isinstance(third, ControlledClient)
        assert (third.calls, supervisor.health, third.state.paused) == (["Pause", "Sleep"], "sleeping", True)
        nursery.cancel_scope.cancel()
