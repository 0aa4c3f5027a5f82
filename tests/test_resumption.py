"""Requests that survive the death of their engine core (docs/supervision.md,
"What happens to a request"): resumed on a ready engine as continuations of
their tokens so far, token for token what they would have been. Real
processes and the fake runner; a tiny real model where the tokens must be a
model's (greedy and seeded sampling)."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import signal
import time

import pytest
import trio
from helpers.concurrent import assert_idle_and_clean
from helpers.fakes import RESTARTING, fake_tokens, wait_no_children
from helpers.server import open_ws, raw_request, serving
from helpers.waiting import in_thread
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import trioserve
from trioserve import RequestOutput, SamplingParams
from trioserve.errors import EngineDeadError
from trioserve.server.metrics import ServerMetrics
from trioserve.server.protocol import Generate, ProtocolError, parse_client_message

pytestmark = pytest.mark.fake_config(**RESTARTING)
NUM_STREAMS = 32
GREEDY = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)


class Seen:
    """What one request's consumer saw: every delta merged, and how it ended."""

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.engine_index: int | None = None  # where it started
        self.arrivals: list[float] = []  # when each output came
        self.ended_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return 0 if self.output is None else len(self.output.token_ids)


def pause_after(seen: Seen, killed_at: float) -> float:
    """The longest wait between two outputs of ``seen`` ending after ``killed_at``
    (an output sent before the kill may still arrive just after it)."""
    arrivals = seen.arrivals
    return max(b - a for a, b in itertools.pairwise(arrivals) if b > killed_at)


async def read(engine: trioserve.Engine, prompt: list[int], params: SamplingParams, seen: Seen, **options) -> None:
    try:
        async with engine.stream(prompt, params, **options) as stream:
            seen.engine_index = stream.engine_index
            async for out in stream:
                seen.arrivals.append(time.monotonic())
                if seen.output is None:
                    seen.output = out
                else:
                    seen.output.merge(out)
    except EngineDeadError as exc:
        seen.error = exc
    seen.ended_at = time.monotonic()


async def run_all(engine: trioserve.Engine, prompts, params, *, kill=None) -> list[Seen]:
    """Every prompt streamed at once; with ``kill`` (an async function given
    the requests' ``Seen``), that runs beside them."""
    seen = [Seen() for _ in prompts]
    async with trio.open_nursery() as nursery:
        for prompt, one in zip(prompts, seen, strict=True):
            nursery.start_soon(read, engine, prompt, params, one)
        if kill is not None:
            await kill(seen)
    return seen


async def until(predicate, seconds: float = 20.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.005)


def metric_totals(metrics: ServerMetrics) -> dict[str, float]:
    """Each metric's samples summed over every engine."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def victim_pid(engine: trioserve.Engine, index: int, victim: str) -> int:
    info = engine._group.supervisors[index].info
    assert info is not None
    return info.engine_pid if victim == "engine-core" else info.worker_pids[0]


@pytest.mark.parametrize("victim", ["engine-core", "worker"])
@pytest.mark.parametrize("engines", [2, 1])
async def test_kill_9_under_32_greedy_streams_every_stream_completes_token_for_token(
    fake_config, caplog, engines, victim
):
    """With two engines, the killed engine's streams go on on the other one at
    once; with one, on the engine once it restarted. Each output (tokens,
    text, finish) is the one the same request gave without the kill."""
    config = fake_config(
        data_parallel_size=engines, step_delay_s=0.005, num_kv_blocks=1024, max_num_seqs=NUM_STREAMS,
        shutdown_grace_s=20.0,
    )  # fmt: skip
    prompts = [[3 + i, 40 + i % 7, 5] for i in range(NUM_STREAMS)]
    killed = engines - 1  # the last engine
    with trio.fail_after(90):
        async with trioserve.open_engine(config=config) as engine:
            undisturbed = await run_all(engine, prompts, GREEDY)
            metrics = ServerMetrics(engines)
            engine.add_request_observer(metrics.observe)

            async def kill(seen: list[Seen]) -> None:
                await until(lambda: all(s.num_tokens >= 5 for s in seen))
                os.kill(victim_pid(engine, killed, victim), signal.SIGKILL)

            with caplog.at_level(logging.WARNING, logger="trioserve.resume"):
                disturbed = await run_all(engine, prompts, GREEDY, kill=kill)
            on_victim = [s.engine_index == killed for s in disturbed]
            assert any(on_victim) and (engines == 1 or not all(on_victim))
            for prompt, before, after, resumed in zip(prompts, undisturbed, disturbed, on_victim, strict=True):
                assert after.error is None and before.output is not None and after.output is not None
                assert after.output.token_ids == before.output.token_ids == fake_tokens(prompt, 60)
                assert after.output.text == before.output.text
                assert (after.output.finish_reason, after.output.num_output_tokens) == ("length", 60)
                assert (before.output.num_resumes, after.output.num_resumes) == (0, int(resumed))
            resumptions = [r for r in caplog.records if "resumed on" in r.getMessage()]
            assert len(resumptions) == sum(s.output.num_resumes for s in disturbed if s.output) > 0
            assert f"engine-core-{killed} died; resumed on engine-core-" in resumptions[0].getMessage()
            counted = metric_totals(metrics)
            assert counted["trioserve_resumed_requests_total"] == counted["trioserve_request_resumptions_total"]
            assert counted["trioserve_resumed_requests_total"] == sum(on_victim)
            assert engine.num_restarts_by_engine[killed] == 1
            await engine.wait_ready()
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_a_request_that_kills_every_engine_it_runs_on_ends_after_max_resumes_and_the_others_complete(
    fake_config,
):
    """The poisoned request asked for engine 0: each life of it dies as it is
    given the request, which is resumed there again, twice (max_resumes=2),
    then ends with engine_dead naming its resumptions. The others, spread
    over both engines, go on on engine 1 and complete."""
    config = fake_config(
        data_parallel_size=2, step_delay_s=0.005, num_kv_blocks=1024, max_num_seqs=16, max_restarts=5,
        die_on_prompt_token=250,
    )  # fmt: skip
    prompts = [[3 + i, 17] for i in range(8)]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            poisoned = Seen()

            async def poison(seen: list[Seen]) -> None:
                await until(lambda: all(s.num_tokens >= 3 for s in seen))
                await read(engine, [250, 3, 4], params, poisoned, engine_index=0)

            others = await run_all(engine, prompts, params, kill=poison)
            assert isinstance(poisoned.error, EngineDeadError)
            message = str(poisoned.error)
            assert "engine-core-0 died: worker-0" in message and "exited with code 3" in message
            assert "was resumed 2 time(s) already (max_resumes=2): not again" in message
            await until(lambda: engine.engine_healths == ["ready", "ready"])
            assert engine.num_restarts_by_engine == [3, 0]  # the first death, then one per resumption
            for prompt, seen in zip(prompts, others, strict=True):
                assert seen.error is None and seen.output is not None
                assert seen.output.token_ids == fake_tokens(prompt, 200)
                assert seen.output.num_resumes == (1 if seen.engine_index == 0 else 0)
            assert {s.engine_index for s in others} == {0, 1}
        assert await wait_no_children() == []


async def test_without_resumption_or_past_max_resumes_requests_end_with_engine_dead_as_before(fake_config):
    for config, expected in (
        (fake_config(raise_at_step=3, resume_requests=False), r"^engine-core-0 died: worker-0 .*InjectedFault"),
        (fake_config(raise_at_step=3, max_resumes=0), r"was resumed 0 time\(s\) already \(max_resumes=0\)"),
    ):
        with trio.fail_after(30):
            async with trioserve.open_engine(config=config) as engine:
                with pytest.raises(EngineDeadError, match=expected):
                    await engine.generate([1, 2, 3], SamplingParams(max_tokens=20))
                await engine.wait_ready()
                assert engine.num_requests_in_flight() == 0
    assert await wait_no_children() == []


async def test_a_request_left_while_it_waits_to_be_resumed_is_not_resumed(fake_config):
    """Its engine restarts only after a long backoff: the request waits for it;
    its consumer leaves meanwhile, and the new engine core never sees it."""
    config = fake_config(step_delay_s=0.01, restart_backoff_s=1.0)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            old = engine.info
            async with engine.stream([7, 8], SamplingParams(max_tokens=1000, ignore_eos=True)) as stream:
                await stream.__anext__()
                os.kill(old.engine_pid, signal.SIGKILL)
                await until(lambda: engine.health == "restarting")
                assert engine.num_requests_in_flight() == 1  # on its way to the next life
            await until(lambda: engine._group.resumptions.num_waiting == 0)  # (it waited for the restart)
            await assert_idle_and_clean(engine)
            assert (await engine.stats()).num_requests == 0
        assert await wait_no_children() == []


@pytest.mark.model
async def test_greedy_and_seeded_streams_resumed_after_a_kill_give_the_tokens_of_the_undisturbed_run(tiny_model_dir):
    """A tiny real model on two engines: greedy requests, and seeded ones at
    temperature 1 and top-p 0.9 (each draw a function of the seed and the
    token's position), give the same tokens and logprobs whether or not the
    engine they ran on was killed under them."""
    prompts = [[1, 3 + i, 40 + 5 * i, 9] for i in range(8)]
    greedy = SamplingParams(max_tokens=80, ignore_eos=True, temperature=0, logprobs=2)
    params = [
        greedy
        if i % 2
        else SamplingParams(max_tokens=80, ignore_eos=True, temperature=1.0, top_p=0.9, seed=i, logprobs=2)
        for i in range(8)
    ]
    model = str(tiny_model_dir("llama"))
    # Not restarted (max_restarts=0): the killed engine's streams resume on the other, long before a new
    # worker could import torch and load the model; restarting it only cost that import.
    config = trioserve.EngineConfig(model=model, data_parallel_size=2, max_num_seqs=8, max_restarts=0)

    async def run(engine: trioserve.Engine, kill=None) -> list[Seen]:
        seen = [Seen() for _ in prompts]
        async with trio.open_nursery() as nursery:
            for prompt, one, p in zip(prompts, seen, params, strict=True):
                nursery.start_soon(read, engine, prompt, p, one)
            if kill is not None:
                await kill(seen)
        return seen

    with trio.fail_after(180):
        async with trioserve.open_engine(config=config) as engine:
            undisturbed = await run(engine)

            async def kill(seen: list[Seen]) -> None:
                await until(lambda: all(s.num_tokens >= 3 for s in seen), 60)
                os.kill(victim_pid(engine, 1, "engine-core"), signal.SIGKILL)

            disturbed = await run(engine, kill)
    resumed = 0
    for before, after in zip(undisturbed, disturbed, strict=True):
        assert after.error is None and before.output is not None and after.output is not None
        assert after.output.token_ids == before.output.token_ids and len(after.output.token_ids) == 80
        assert [lp.top_token_ids for lp in after.output.logprobs or []] == [
            lp.top_token_ids for lp in before.output.logprobs or []
        ]
        resumed += after.output.num_resumes
    assert resumed == sum(s.engine_index == 1 for s in disturbed) > 0
    assert len({tuple(s.output.token_ids) for s in undisturbed if s.output}) == 8  # seeds and prompts differ


def ws_requests(url: str) -> list[dict]:
    """Two requests on one WebSocket, one asking for its resumptions: every message of both."""
    messages: list[dict] = []
    with open_ws(url) as ws:
        for request_id, options in (("asked", {"stream_options": {"include_resumes": True}}), ("plain", {})):
            params = {"max_tokens": 300, "ignore_eos": True}
            ws.send(
                json.dumps(
                    {"type": "generate", "id": request_id, "prompt_token_ids": [9, 8], "params": params, **options}
                )
            )
        while sum(m["type"] != "delta" for m in messages) < 2:
            messages.append(json.loads(ws.recv(timeout=30)))
    return messages


async def test_streams_say_how_often_they_were_resumed_only_when_asked(fake_config):
    """WebSocket and OpenAI streams: ``num_resumes`` on each delta (and the
    WebSocket's ``done``) with ``stream_options.include_resumes``, nothing new
    without it; the tokens are whole, none repeated."""
    body = {
        "model": "m", "prompt": [9, 8], "max_tokens": 300, "ignore_eos": True, "stream": True,
        "stream_options": {"include_resumes": True},
    }  # fmt: skip
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01, num_kv_blocks=512), model_name="m") as server:
            engine = server.engine
            assert engine is not None
            pid = engine.info.engine_pid
            results: dict[str, object] = {}

            async def sse() -> None:
                results["sse"] = await in_thread(
                    raw_request, server, "POST", "/v1/completions", json.dumps(body).encode()
                )

            async def ws() -> None:
                results["ws"] = await in_thread(ws_requests, server.url)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sse)
                nursery.start_soon(ws)
                await until(lambda: engine.num_requests_in_flight() == 3)
                await trio.sleep(0.2)  # some tokens out
                os.kill(pid, signal.SIGKILL)
    expected = fake_tokens([9, 8], 300)
    messages = results["ws"]
    assert isinstance(messages, list)
    for request_id in ("asked", "plain"):
        deltas = [m for m in messages if m["id"] == request_id and m["type"] == "delta"]
        (done,) = [m for m in messages if m["id"] == request_id and m["type"] != "delta"]
        assert [t for d in deltas for t in d["token_ids"]] == expected and done["type"] == "done"
        if request_id == "plain":
            assert "num_resumes" not in done and all("num_resumes" not in d for d in deltas)
        else:
            counts = [d["num_resumes"] for d in deltas]
            assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 1 == done["num_resumes"]
    status, _, payload = results["sse"]  # type: ignore[misc]
    chunks = [json.loads(line[6:]) for line in payload.decode().split("\r\n") if line.startswith("data: {")]
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    counts = [c["choices"][0]["num_resumes"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 1


async def test_in_lockstep_every_request_is_resumed_once_both_engines_restarted(fake_config):
    """One lockstep engine dying takes the other with it (they may wait in
    its collective): every request of both is resumed once both are back,
    and completes token for token."""
    config = fake_config(data_parallel_size=2, data_parallel_lockstep=True, step_delay_s=0.005, num_kv_blocks=256)
    prompts = [[3 + i, 4] for i in range(6)]
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:

            async def kill(seen: list[Seen]) -> None:
                await until(lambda: all(s.num_tokens >= 3 for s in seen))
                os.kill(victim_pid(engine, 1, "engine-core"), signal.SIGKILL)

            seen = await run_all(engine, prompts, GREEDY, kill=kill)
            for prompt, one in zip(prompts, seen, strict=True):
                assert one.error is None and one.output is not None and one.output.num_resumes == 1
                assert one.output.token_ids == fake_tokens(prompt, 60)
            assert engine.num_restarts_by_engine == [1, 1] and engine._group.generation == 1
        assert await wait_no_children() == []


@pytest.mark.parametrize(
    ("options", "field"),
    [({"include_resumes": 1}, "stream_options.include_resumes"), ({"resumes": True}, "stream_options.resumes"),
     ([True], "stream_options")],
)  # fmt: skip
def test_a_websocket_stream_options_that_is_not_one_is_an_error_naming_its_field(options, field):
    frame = json.dumps({"type": "generate", "id": "r", "prompt": "hi", "stream_options": options})
    with pytest.raises(ProtocolError) as info:
        parse_client_message(frame)
    assert (info.value.code, info.value.field, info.value.id) == ("invalid_field", field, "r")
    asked = parse_client_message(json.dumps({"type": "generate", "id": "r", "prompt": "hi"}))
    assert isinstance(asked, Generate) and not asked.include_resumes


async def test_a_request_that_asked_for_the_dead_engine_waits_for_it_and_holds_up_none_of_the_others(fake_config):
    """Engine 1 restarts only after a 2 s backoff: the requests that were on
    it go on on engine 0 at once, but the one that asked for engine 1 waits
    for it, and is resumed there."""
    config = fake_config(data_parallel_size=2, step_delay_s=0.005, num_kv_blocks=512, restart_backoff_s=2.0)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            pinned, others = Seen(), [Seen() for _ in range(6)]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(read, engine, [9, 9], params, pinned, engine_index=1))
                for i, seen in enumerate(others):
                    nursery.start_soon(read, engine, [3 + i, 4], params, seen)
                await until(lambda: all(s.num_tokens >= 3 for s in [pinned, *others]))
                assert any(s.engine_index == 1 for s in others)
                os.kill(victim_pid(engine, 1, "engine-core"), signal.SIGKILL)
                killed_at = time.monotonic()
            for prompt, seen in [([9, 9], pinned), *(([3 + i, 4], s) for i, s in enumerate(others))]:
                assert seen.error is None and seen.output is not None
                assert seen.output.token_ids == fake_tokens(prompt, 400)
            moved = [s for s in others if s.engine_index == 1]
            for seen in moved:
                assert pause_after(seen, killed_at) < 1.5  # engine 0, at once
            assert pause_after(pinned, killed_at) > 2.0  # engine 1's next life
            assert pinned.output is not None and pinned.output.num_resumes == 1
        assert await wait_no_children() == []


async def test_with_no_engine_back_within_restart_wait_s_every_waiting_request_ends_at_once(fake_config):
    """Not one restart_wait_s after another: the first that finds no engine
    ends them all."""
    config = fake_config(step_delay_s=0.005, restart_backoff_s=5.0, restart_wait_s=0.5)
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            killed_at = 0.0

            async def kill(seen: list[Seen]) -> None:
                nonlocal killed_at
                await until(lambda: all(s.num_tokens >= 3 for s in seen))
                os.kill(engine.info.engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()

            seen = await run_all(engine, [[3 + i, 4] for i in range(4)], params, kill=kill)
            for one in seen:
                assert isinstance(one.error, EngineDeadError)
                assert (
                    "could not be resumed: engine-core-0 is restarting and was not ready within restart_wait_s=0.5s"
                    in str(one.error)
                )
                assert one.ended_at is not None and 0.4 < one.ended_at - killed_at < 1.4
            assert engine.num_requests_in_flight() == 0
        assert await wait_no_children() == []
