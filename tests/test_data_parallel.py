"""Data parallelism: engine cores side by side behind one front-end
(docs/architecture.md, "Data parallel"). Real processes; the fake runner
unless the model itself matters.

Tests that need no engine of their own share one of two (``HostedEngine``),
a class's: two engines on the fake runner, 5 ms steps, side by side
(``TestOnTwoEnginesSideBySide``) or in lockstep (``TestInLockstep``)."""

from __future__ import annotations

import functools
import os
import signal
import time
from functools import partial

import pytest
import trio
from helpers.concurrent import Outcome, consume_stream, run_concurrently
from helpers.fakes import children, fake_tokens, make_fake_config, wait_no_children
from helpers.hosted import HostedEngine, held
from helpers.reference import reference_greedy

import trioserve
from trioserve import SamplingParams
from trioserve.errors import EngineDeadError

DP_OPTIONS = {"data_parallel_size": 2, "restart_backoff_s": 0.05, "num_kv_blocks": 256, "max_num_seqs": 4}


@pytest.fixture
def dp_config(fake_config):
    return functools.partial(fake_config, **DP_OPTIONS)


@pytest.mark.model
async def test_two_engines_give_the_greedy_tokens_of_transformers(tiny_model_dir):
    """One engine gives transformers' own greedy tokens (test_engine_models):
    two give them too."""
    model = str(tiny_model_dir("llama"))
    prompts = [[3 + i, 17, 42 + 7 * i, 9][: 2 + i % 3] for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with trio.fail_after(180):
        async with trioserve.open_engine(model=model, data_parallel_size=2, max_num_seqs=8) as engine:
            expected = await trio.to_thread.run_sync(reference_greedy, model, prompts, 12)
            assert await run_concurrently(engine, prompts, params) == expected
            per_engine = [e.num_requests for e in (await engine.stats()).engines]
            assert sum(per_engine) == 16 and min(per_engine) > 0


@pytest.mark.parametrize("victim", ["engine-core", "worker"])
async def test_kill_9_of_one_engine_ends_only_its_requests_and_it_comes_back(dp_config, victim):
    # Requests are not resumed here (test_resumption.py: they are by default, on the other engine).
    config = dp_config(step_delay_s=0.01, shutdown_grace_s=20.0, resume_requests=False)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            outcomes: list[tuple[Outcome, trioserve.RequestStream]] = []
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    stream = engine.stream([3 + i, 4, 5], SamplingParams(max_tokens=300, ignore_eos=True))
                    outcome = Outcome()
                    outcomes.append((outcome, stream))
                    nursery.start_soon(consume_stream, stream, outcome)
                for outcome, _ in outcomes:
                    await outcome.started.wait()
                info = engine._group.supervisors[1].info  # engine 1's processes
                assert info is not None
                pid = info.engine_pid if victim == "engine-core" else info.worker_pids[0]
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            for outcome, stream in outcomes:
                if stream.engine_index == 1:
                    assert isinstance(outcome.error, EngineDeadError), outcome.finish_reason
                    assert outcome.ended_at is not None and outcome.ended_at - killed_at < 1.0
                else:
                    assert outcome.error is None and outcome.finish_reason == "length"
                    assert len(outcome.token_ids) == 300
            assert engine._group.supervisors[0].num_restarts == 0
            with trio.fail_after(10):
                await engine.wait_ready()
                while engine.engine_healths != ["ready", "ready"]:
                    await trio.sleep(0.05)
            assert engine.num_restarts == 1
            # Both serve again, and only the live engines' processes are left.
            served = set()
            for i in range(8):
                async with engine.stream([7, i], SamplingParams(max_tokens=2)) as stream:
                    async for _ in stream:
                        pass
                    served.add(stream.engine_index)
            assert served == {0, 1}
            expected = {
                p for s in engine._group.supervisors if s.info for p in (s.info.engine_pid, *s.info.worker_pids)
            }
            assert {p.pid for p in children()} == expected and len(expected) == 4
        assert await wait_no_children() == []


async def test_a_failed_start_of_one_engine_names_it_and_leaves_no_process(dp_config):
    config = dp_config(hang_at_load=True, fault_rank=0, model_load_timeout_s=1.0, data_parallel_size=3)
    with trio.fail_after(30):
        with pytest.raises(trioserve.EngineStartupError) as info:
            async with trioserve.open_engine(config=config):
                pass
        assert info.value.stage == "model-load" and "engine-core-" in str(info.value)
    assert await wait_no_children() == []


# --- lockstep -------------------------------------------------------------------


async def _bursts(engine: trioserve.Engine, per_burst: int) -> list[list[int]]:
    """A burst to engine 0 only, then one to engine 1 only, then both: every
    request finishes; the engines' step counts once they paused."""
    for target in (0, 1, None):
        async with trio.open_nursery() as nursery:
            for i in range(per_burst):
                params = SamplingParams(max_tokens=5 + i, ignore_eos=True)
                nursery.start_soon(partial(engine.generate, [3 + i, 4], params, engine_index=target))
    counts: list[list[int]] = []
    for _ in range(100):  # the wave ends at the next sync step: wait for both to pause
        stats = await engine.stats()
        counts.append([e.num_steps for e in stats.engines])
        if len(counts) > 3 and counts[-1] == counts[-4]:
            break
        await trio.sleep(0.05)
    return counts


@pytest.mark.model
async def test_lockstep_on_the_real_collective_runs_bursts_and_gives_the_greedy_tokens_of_transformers(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with trio.fail_after(240):
        expected = await trio.to_thread.run_sync(reference_greedy, model, [[3, 9, i] for i in range(4)], 8)
        options = {"data_parallel_size": 2, "data_parallel_lockstep": True, "max_num_seqs": 4}
        async with trioserve.open_engine(model=model, **options) as engine:
            got = {}
            for target in (0, 1):
                async with trio.open_nursery() as nursery:
                    for i in range(4):

                        async def one(i: int = i, target: int = target) -> None:
                            got[target, i] = (await engine.generate([3, 9, i], params, engine_index=target)).token_ids

                        nursery.start_soon(one)
            assert [got[0, i] for i in range(4)] == expected == [got[1, i] for i in range(4)]
            counts = await _bursts(engine, per_burst=2)
            assert counts[-1][0] == counts[-1][1]


async def test_in_lockstep_one_engine_dying_restarts_them_all_and_they_serve_again(dp_config):
    # Requests are not resumed here (test_resumption.py: they are by default, once both restarted).
    config = dp_config(data_parallel_lockstep=True, step_delay_s=0.005, resume_requests=False)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            outcomes: list[tuple[Outcome, trioserve.RequestStream]] = []
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    stream = engine.stream([3 + i, 4], SamplingParams(max_tokens=10_000, ignore_eos=True))
                    outcome = Outcome()
                    outcomes.append((outcome, stream))
                    nursery.start_soon(consume_stream, stream, outcome)
                for outcome, _ in outcomes:
                    await outcome.started.wait()
                info = engine._group.supervisors[1].info
                assert info is not None
                os.kill(info.engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()
            for outcome, _ in outcomes:  # both engines' requests: the survivor was stuck with the dead one
                assert isinstance(outcome.error, EngineDeadError)
                assert outcome.ended_at is not None and outcome.ended_at - killed_at < 1.0
            while engine.engine_healths != ["ready", "ready"]:
                await trio.sleep(0.05)
            counts = await _bursts(engine, per_burst=3)
            assert counts[-1][0] == counts[-1][1] and engine._group.generation == 1
            assert [s.num_restarts for s in engine._group.supervisors] == [1, 1]
        assert await wait_no_children() == []


# --- on shared engines ------------------------------------------------------------------


def hosted_dp_engine(tiny_model_dir, **options):
    """Two engines on the fake runner, 5 ms steps, for the tests of a class:
    gone before the tests after it count processes."""
    yield from held(
        HostedEngine(make_fake_config(str(tiny_model_dir("llama")), **DP_OPTIONS, step_delay_s=0.005, **options))
    )


def check_constrained_beside_unconstrained(host: HostedEngine) -> None:
    """Each engine core compiles and applies its own requests' grammars; the
    unconstrained requests give the runner's own tokens."""
    from trioserve.structured import Regex

    constrained = SamplingParams(max_tokens=50, structured=Regex(pattern="[a-f]{3}-[0-9]{2}"))
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    results: dict = {}

    async def scenario(engine: trioserve.Engine) -> None:
        async def one(key: tuple[str, int], params: SamplingParams, engine_index: int) -> None:
            results[key] = await engine.generate([10 + key[1], 11], params, engine_index=engine_index)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, ("plain", i), plain, i % 2)
                nursery.start_soon(one, ("constrained", i), constrained, i % 2)

    host.call(scenario, bound_s=60)
    for i in range(6):
        assert results["plain", i].token_ids == fake_tokens([10 + i, 11], 8)
        out = results["constrained", i]
        assert out.finish_reason == "stop" and len(out.text) == 6 and out.text[3] == "-", out.text


class TestOnTwoEnginesSideBySide:
    @pytest.fixture(scope="class")
    def dp_engine(self, tiny_model_dir):
        yield from hosted_dp_engine(tiny_model_dir)

    def test_a_uniform_load_is_spread_evenly_and_no_request_waits_while_an_engine_is_idle(self, dp_engine):
        async def scenario(engine: trioserve.Engine) -> None:
            # 8 long requests fill both engines' 4 slots: none waits while the other engine has room.
            streams = [
                engine.stream([3 + i, 4, 5], SamplingParams(max_tokens=10_000, ignore_eos=True)) for i in range(8)
            ]
            async with trio.open_nursery() as nursery:
                for stream in streams:
                    await stream.__aenter__()
                # (Polled: an engine core busy elsewhere may not have stepped them yet. Were one
                # engine given five, one would wait for good and this would time out.)
                with trio.move_on_after(10):
                    while [(e.num_running, e.num_waiting) for e in (await engine.stats()).engines] != [(4, 0)] * 2:
                        await trio.sleep(0.05)
                stats = await engine.stats()
                assert [(e.num_running, e.num_waiting) for e in stats.engines] == [(4, 0), (4, 0)]
                assert sorted(s.engine_index for s in streams) == [0, 0, 0, 0, 1, 1, 1, 1]
                for stream in streams:
                    await stream.__aexit__(None, None, None)
                nursery.cancel_scope.cancel()
            # 64 requests, 16 at a time: each engine takes between 40% and 60% of them.
            limiter = trio.CapacityLimiter(16)
            served: list[int] = []

            async def one(i: int) -> None:
                async with limiter, engine.stream([5 + i % 7, 6], SamplingParams(max_tokens=8)) as stream:
                    async for _ in stream:
                        pass
                    served.append(stream.engine_index)  # type: ignore[arg-type]

            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
            assert 0.4 * 64 <= served.count(0) <= 0.6 * 64, served.count(0)

        dp_engine.call(scenario, bound_s=60)

    def test_tokens_through_two_engines_are_the_runner_tokens(self, dp_engine):
        async def scenario(engine: trioserve.Engine) -> None:
            outs = []
            for i in range(6):
                outs.append(await engine.generate([10 + i, 11], SamplingParams(max_tokens=5, ignore_eos=True)))
            assert [o.token_ids for o in outs] == [fake_tokens([10 + i, 11], 5) for i in range(6)]

        dp_engine.call(scenario, bound_s=30)

    def test_constrained_requests_beside_unconstrained_ones(self, dp_engine):
        check_constrained_beside_unconstrained(dp_engine)


class TestInLockstep:
    @pytest.fixture(scope="class")
    def lockstep_engine(self, tiny_model_dir):
        yield from hosted_dp_engine(tiny_model_dir, data_parallel_lockstep=True)

    def test_lockstep_with_bursts_to_one_engine_then_the_other_never_hangs(self, lockstep_engine):
        async def scenario(engine: trioserve.Engine) -> None:
            before = [e.num_requests for e in (await engine.stats()).engines]
            counts = await _bursts(engine, per_burst=6)
            # Every step of either engine joined the other's: they ran the same number.
            assert counts[-1][0] == counts[-1][1] > 0
            after = [e.num_requests for e in (await engine.stats()).engines]
            assert after[0] - before[0] >= 6 and after[1] - before[1] >= 6

        lockstep_engine.call(scenario, bound_s=60)

    def test_in_lockstep_an_engine_with_no_work_sleeps_while_the_other_finishes_its_wave(self, lockstep_engine):
        """Found: the idle engine slept at once, then its wave's next dummy step
        reached its asleep runner, and both engine cores died. An asleep engine
        takes part in the wave's dummy steps (they compute nothing)."""

        async def scenario(engine: trioserve.Engine) -> None:
            params = SamplingParams(max_tokens=150, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.generate, [3, 4], params, engine_index=0))
                while (await engine.stats()).engines[0].num_running == 0:
                    await trio.sleep(0.01)
                await engine.sleep(1)  # engine 1 sleeps now, engine 0 once its request ends
            assert engine.engine_healths == ["sleeping", "sleeping"]
            await engine.wake_up()
            counts = await _bursts(engine, per_burst=3)
            assert counts[-1][0] == counts[-1][1]
            assert engine.num_restarts == 0

        lockstep_engine.call(scenario, bound_s=60)

    def test_constrained_requests_beside_unconstrained_ones(self, lockstep_engine):
        check_constrained_beside_unconstrained(lockstep_engine)
