"""Requests resumed through hangs, not only kills: an engine core or worker
stopped (SIGSTOP) is declared hung by its heartbeat deadline and killed,
and its requests go on, token for token, on the other engine (two engines)
or on its next life (one). docs/supervision.md, "What happens to a request"."""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio
from helpers.concurrent import assert_idle_and_clean
from helpers.fakes import RESTARTING, fake_tokens, wait_no_children

import trioserve
from trioserve import RequestOutput, SamplingParams
from trioserve.errors import EngineDeadError

pytestmark = pytest.mark.fake_config(**RESTARTING)
FAST_BEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}
NUM_STREAMS = 8
MAX_TOKENS = 200  # at a 15 ms step, about 3 s: still streaming when the hang is declared (context: 256)


@pytest.mark.parametrize(("engines", "victim"), [(2, "engine-core"), (2, "worker"), (1, "engine-core")])
async def test_a_stopped_process_declared_hung_has_its_streams_resumed_token_for_token(fake_config, engines, victim):
    config = fake_config(
        data_parallel_size=engines, step_delay_s=0.015, max_num_seqs=NUM_STREAMS, num_kv_blocks=1024, **FAST_BEATS
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = [[3 + i, 40 + i, 5] for i in range(NUM_STREAMS)]
    outputs: dict[int, RequestOutput] = {}
    errors: list[BaseException] = []
    started: dict[int, int] = {}  # request -> the engine it started on

    async def one(i: int) -> None:
        try:
            async with engine.stream(prompts[i], params) as stream:
                started[i] = stream.engine_index
                async for out in stream:
                    if i in outputs:
                        outputs[i].merge(out)
                    else:
                        outputs[i] = out
        except EngineDeadError as exc:
            errors.append(exc)

    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            victim_engine = engines - 1
            info = engine._group.supervisors[victim_engine].info
            assert info is not None
            pid = info.engine_pid if victim == "engine-core" else info.worker_pids[0]
            async with trio.open_nursery() as nursery:
                for i in range(NUM_STREAMS):
                    nursery.start_soon(one, i)
                while len(outputs) < NUM_STREAMS or min(len(o.token_ids) for o in outputs.values()) < 5:
                    await trio.sleep(0.01)
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
            assert errors == []
            on_victim = [i for i in range(NUM_STREAMS) if started[i] == victim_engine]
            assert on_victim  # the stopped engine had streams, and they were resumed
            for i in range(NUM_STREAMS):
                assert outputs[i].token_ids == fake_tokens(prompts[i], MAX_TOKENS)
                assert outputs[i].finish_reason == "length" and outputs[i].num_output_tokens == MAX_TOKENS
                assert outputs[i].num_resumes == (1 if i in on_victim else 0)
            assert time.monotonic() - stopped_at > config.heartbeat_timeout_s - 2 * config.heartbeat_interval_s
            assert engine.num_restarts_by_engine[victim_engine] == 1
            await engine.wait_ready()
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []
