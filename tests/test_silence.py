"""A watchdog's count of a peer's silence excuses the time its own process
did not run (``transport/silence.py``), on a virtual clock: ``clock.jump``
moves time on while no task runs, as a stopped process sees it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve.transport.silence import Silence, sleep_noting_absence


async def expires_at(silence: Silence, timeout_s: float, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await silence.wait(timeout_s)
    silence.expired_at = trio.current_time()  # type: ignore[attr-defined]


async def test_a_silent_peer_is_found_at_exactly_the_timeout_and_hearing_from_it_starts_the_count_again(
    autojump_clock,
):
    silence = Silence()
    async with trio.open_nursery() as nursery:
        await nursery.start(expires_at, silence, 5.0)
        await trio.sleep(3.0)
        silence.heard()
        assert silence.silent_for() == 0.0
    assert silence.expired and silence.expired_at == pytest.approx(8.0)


async def test_time_this_process_was_away_is_not_the_peers_silence(autojump_clock):
    silence = Silence()
    async with trio.open_nursery() as nursery:
        await nursery.start(expires_at, silence, 5.0)
        await trio.sleep(1.5)
        autojump_clock.jump(100.0)  # stopped for 100 s (SIGSTOP, a paused container): nothing ran
        await trio.testing.wait_all_tasks_blocked()  # the watch has woken, and sleeps again
        assert not silence.expired  # the peer's messages, waiting in a socket, are read before it counts
        assert silence.silent_for() == pytest.approx(2.0)  # the 1.5 s before and the 0.5 s until its next tick
    # Not heard from again: found silent 5 s of this process's own time after the peer's last word.
    assert silence.expired and silence.expired_at == pytest.approx(104.5)


async def test_a_message_read_after_the_absence_keeps_the_peer_alive(autojump_clock):
    silence = Silence()
    async with trio.open_nursery() as nursery:
        await nursery.start(expires_at, silence, 5.0)
        await trio.sleep(4.0)
        autojump_clock.jump(30.0)
        silence.heard()  # the reader ran first this time: what the peer sent while this process was away
        await trio.sleep(2.0)
        assert not silence.expired and silence.silent_for() == pytest.approx(2.0)
        nursery.cancel_scope.cancel()
    assert not silence.expired


async def test_a_wake_up_late_by_scheduling_noise_is_not_an_absence(autojump_clock):
    async def late_by(seconds: float) -> float:
        async with trio.open_nursery() as nursery:
            result: list[float] = []

            async def sleeper() -> None:
                result.append(await sleep_noting_absence(1.0))

            nursery.start_soon(sleeper)
            await trio.sleep(0.5)
            autojump_clock.jump(0.5 + seconds)
        return result[0]

    assert await late_by(0.05) == 0.0
    assert await late_by(3.0) == pytest.approx(3.0)


async def test_silence_read_from_a_clock_excuses_absences_until_the_next_message(autojump_clock):
    last = [0.0]
    silence = Silence(lambda: last[0])
    await trio.sleep(2.0)
    silence.excuse(10.0)  # away longer than the silence so far: it counts from now
    assert silence.silent_for() == 0.0
    await trio.sleep(1.0)
    assert silence.silent_for() == pytest.approx(1.0)
    last[0] = trio.current_time()
    await trio.sleep(0.5)
    assert silence.silent_for() == pytest.approx(0.5)
