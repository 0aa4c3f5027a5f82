"""Control calls through the public ``Engine`` as a Trio programmer may get
them wrong (found by a review of the embedding API): each is refused at once
naming what was wrong, or ends in the state the engine core itself reports,
and the engine serves on."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import trio
from helpers.fakes import fake_tokens, make_fake_config
from helpers.hosted import HostedEngine, held

import trioserve
from trioserve import SamplingParams
from trioserve.errors import ControlCallError, EngineDeadError, InvalidRequestError
from trioserve.rpc import DescribeShard, Echo

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    """One engine (the fake runner, 10 ms steps) for the tests that leave it
    as they found it: ready, idle, never restarted (each checks so)."""
    yield from held(HostedEngine(make_fake_config(str(tiny_model_dir("llama")), step_delay_s=0.01)))


def test_arguments_the_engine_core_could_not_take_are_refused_at_once_naming_them(shared):
    """Found: ``sleep(level=True)`` and ``Echo(text=123)`` passed the checks and
    were dropped by the engine core as malformed; the caller waited out the
    timeout, health said ``paused`` for good, and every restart replayed the
    call. A timeout of 1e-6 s on a call that runs on the workers killed a
    healthy engine core, and every request on it."""

    async def scenario(engine: trioserve.Engine) -> None:
        with trio.fail_after(30):
            for level in (True, 1.0, 2.0, 3):
                with pytest.raises(InvalidRequestError, match=rf"^level: must be 1 or 2 \(got {level!r}\)"):
                    await engine.sleep(level)  # type: ignore[arg-type]
            for call, path in ((Echo(text=123), "text"), (Echo(fail_on_rank="x"), "fail_on_rank")):  # type: ignore[arg-type]
                with pytest.raises(InvalidRequestError, match=rf"^call: Echo: Expected .* at `\$\.{path}`"):
                    await engine.collective_rpc(call)
            for method in (engine.collective_rpc, engine.sleep, engine.wake_up):
                args = (Echo("x"),) if method == engine.collective_rpc else ()
                with pytest.raises(InvalidRequestError, match=r"^timeout_s: must be at least 1 s for \w+, which runs"):
                    await method(*args, timeout_s=1e-6)  # type: ignore[operator]
            with pytest.raises(InvalidRequestError, match=r"^timeout_s: must be a positive number"):
                await engine.pause(timeout_s=True)
            assert (engine.health, engine.num_restarts) == ("ready", 0)
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=3))).token_ids == fake_tokens([5, 6], 3)

    shared.call(scenario)


def test_wait_ready_returns_while_paused_or_asleep_and_a_cancelled_call_raises_a_bare_cancelled(shared):
    """Found: ``wait_ready()`` waited for ever on an engine that was up but
    paused or asleep; a cancelled control call raised a group holding
    ``Cancelled``, which ``except trio.Cancelled`` misses."""

    async def scenario(engine: trioserve.Engine) -> None:
        with trio.fail_after(30):
            await engine.pause()
            with trio.fail_after(2):
                await engine.wait_ready()
            await engine.sleep(1)
            assert engine.health == "sleeping"
            with trio.fail_after(2):
                await engine.wait_ready()
            await engine.wake_up()
            await engine.resume()
            async with engine.stream([5, 6], LONG) as stream:
                await stream.__anext__()
                caught: list[BaseException] = []
                with trio.move_on_after(0.3):  # the pause waits for the long request to end
                    try:
                        await engine.pause()
                    except BaseException as exc:
                        caught.append(exc)
                        raise
                assert [type(exc) for exc in caught] == [trio.Cancelled]
                await engine.resume()
                await stream.__anext__()  # it runs on
            assert (engine.health, engine.num_restarts) == ("ready", 0)

    shared.call(scenario)


def test_health_says_paused_while_a_sleep_waits_for_the_requests_to_end(shared):
    """Found: another call's reply turned health to ``ready`` while the sleep
    still waited and new requests were held."""

    async def scenario(engine: trioserve.Engine) -> None:
        with trio.fail_after(30):
            async with engine.stream([5, 6], SamplingParams(max_tokens=150, ignore_eos=True)) as stream:
                await stream.__anext__()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(engine.sleep)
                    while engine.health == "ready":
                        await trio.sleep(0.01)
                    await engine.collective_rpc(DescribeShard())
                    assert engine.health == "paused"  # new requests are held
                    async for _ in stream:
                        pass
            assert engine.health == "sleeping"
            await engine.wake_up()
            assert engine.health == "ready"

    shared.call(scenario)


async def test_a_stream_entered_by_two_tasks_at_once_runs_once(fake_config):
    """Found: both tasks submitted it (with two engines, one copy ran on with
    nobody reading it, holding its KV blocks)."""
    with trio.fail_after(30):
        async with trioserve.open_engine(config=fake_config(step_delay_s=0.01)) as engine:
            stream = engine.stream([5, 6, 7], LONG)
            outcomes: list[str] = []
            refused = trio.Event()

            async def enter() -> None:
                try:
                    async with stream:
                        outcomes.append("entered")
                        with trio.move_on_after(10):  # inside while the other task tries: until it is refused
                            await refused.wait()
                except RuntimeError as exc:
                    assert "a stream runs once" in str(exc)
                    outcomes.append("refused")
                    refused.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(enter)
                nursery.start_soon(enter)
            assert sorted(outcomes) == ["entered", "refused"]
            with trio.fail_after(5):
                while (stats := await engine.stats()).num_running or stats.num_free_blocks < stats.num_total_blocks:
                    await trio.sleep(0.02)
        with pytest.raises(EngineDeadError, match="is stopped"):
            await engine.wait_failed()  # found: waited for ever once the engine was closed


@pytest.mark.parametrize("resumed", [False, True])
async def test_the_next_life_of_a_killed_engine_core_is_paused_as_the_last_one_said(fake_config, resumed):
    """A pause still waiting for a request when the engine core is killed
    holds for its next life; one resumed before does not come back."""
    with trio.fail_after(60):
        config = fake_config(step_delay_s=0.01, restart_backoff_s=0.1, resume_requests=False)  # the stream ends
        async with trioserve.open_engine(config=config) as engine:
            pid = engine.info.engine_pid
            if resumed:
                await engine.pause()
                await engine.resume()

            async def pause() -> None:
                with contextlib.suppress(ControlCallError):  # the engine core dies before it answers
                    await engine.pause()

            async with trio.open_nursery() as nursery:
                async with engine.stream([5, 6], LONG) as stream:
                    await stream.__anext__()
                    if not resumed:
                        nursery.start_soon(pause)  # it waits for the stream's request to end
                        while engine.health != "paused":
                            await trio.sleep(0.01)
                        await engine.stats()  # answered after the pause: the engine core holds it
                    os.kill(pid, signal.SIGKILL)
                    with pytest.raises(EngineDeadError):
                        async for _ in stream:
                            pass
                    nursery.cancel_scope.cancel()
            await engine.wait_ready()
            assert engine.num_restarts == 1
            assert engine.health == ("ready" if resumed else "paused")
            if not resumed:
                await engine.resume()
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=3))).token_ids == fake_tokens([5, 6], 3)
