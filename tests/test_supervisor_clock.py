"""The supervisor's restart schedule, on Trio's virtual clock.

No process is started: the supervisor is given a fake engine-core client
(its ``client_factory`` seam) that is "ready" at once and dies when the test
says. Every time asserted is exact, because ``autojump_clock`` only moves
when every task is blocked.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from trioserve import EngineConfig
from trioserve.errors import EngineDeadError
from trioserve.frontend.client import EngineCoreClient
from trioserve.frontend.supervisor import EngineSupervisor
from trioserve.messages import EngineInfo, ModelInfo

INFO = EngineInfo(
    model=ModelInfo(vocab_size=259, max_model_len=64, eos_token_ids=[2]),
    num_kv_blocks=16, block_size=4, max_model_len=64, engine_pid=1, worker_pids=[2],
)  # fmt: skip


class FakeClient(EngineCoreClient):
    """An engine-core life with no process: ready at once, dead on ``kill()``."""

    def __init__(self, config: EngineConfig, index: int, on_dead: Callable[[EngineCoreClient], None]) -> None:
        super().__init__(config, index, on_dead=on_dead)
        self.started_at = trio.current_time()
        self._killed = trio.Event()

    def kill(self) -> None:
        self._killed.set()

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        self.info = INFO
        task_status.started(INFO)
        await self._killed.wait()
        self._die("killed by the test")


class Lives:
    """Every fake client the supervisor made, in order."""

    def __init__(self) -> None:
        self.clients: list[FakeClient] = []
        self.changed = trio.Event()

    def factory(self, config: EngineConfig, index: int, on_dead: Callable[[EngineCoreClient], None]) -> FakeClient:
        client = FakeClient(config, index, on_dead)
        self.clients.append(client)
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
