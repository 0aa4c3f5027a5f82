"""Elastic data parallelism (``Engine.scale``, ``frontend/engines/scaling.py``): the engine cores grown and shrunk
under a steady load, on the fake runner; no request lost or sent to a departing engine."""

from __future__ import annotations

import functools
import json

import psutil
import pytest
import trio
import trio.testing
from helpers.concurrent import run_concurrently
from helpers.fakes import fake_tokens, wait_no_children
from helpers.server import http_get, raw_request, serving
from helpers.serving import running
from helpers.waiting import in_thread

import trioserve
from trioserve import SamplingParams
from trioserve.errors import ControlCallError, EngineDeadError, InvalidRequestError
from trioserve.frontend.requests.outputs import RequestMetrics

pytestmark = pytest.mark.fake_config(step_delay_s=0.01, num_kv_blocks=256, restart_backoff_s=0.05)


class Load:
    """Requests arriving every ``interval_s`` until stopped; each one's tokens
    checked against the fake runner's, and the engine (and time) it was routed to."""

    def __init__(self, engine: trioserve.Engine, interval_s: float = 0.02, max_tokens: int = 8) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.params = SamplingParams(max_tokens=max_tokens)
        self.sent = 0
        self.done: list[int] = []
        self.failed: list[BaseException] = []
        self.routed: list[tuple[float, int]] = []  # (submission time, engine index), by end
        engine.add_request_observer(self._ended)

    def _ended(self, metrics: RequestMetrics) -> None:
        self.routed.append((trio.current_time() - metrics.e2e_s, metrics.engine_index))

    async def one(self, i: int) -> None:
        prompt = [5 + i % 50, 7]
        try:
            output = await self.engine.generate(prompt, self.params)
        except (EngineDeadError, ControlCallError) as exc:
            self.failed.append(exc)
            return
        assert output.token_ids == fake_tokens(prompt, self.params.max_tokens)
        self.done.append(i)

    async def arrive(self, requests: trio.Nursery, stop: trio.Event) -> None:
        """Start a request in ``requests`` every ``interval_s`` until ``stop``."""
        while not stop.is_set():
            requests.start_soon(self.one, self.sent)
            self.sent += 1
            with trio.move_on_after(self.interval_s):
                await stop.wait()


async def test_one_to_two_to_one_engines_under_a_steady_load_loses_no_request(fake_config):
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config()) as engine:
            load = Load(engine)
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load.arrive, nursery, stop)
                await trio.sleep(0.3)
                await engine.scale(2, drain_timeout_s=10)
                ready_at = trio.current_time()
                assert engine.engine_healths == ["ready", "ready"] and engine.config.data_parallel_size == 2
                assert len((await engine.stats()).engines) == 2
                new_pids = [engine.engine_infos[1].engine_pid, *engine.engine_infos[1].worker_pids]
                await trio.sleep(0.5)
                await engine.scale(1, drain_timeout_s=10)
                assert engine.engine_healths == ["ready"] and engine.config.data_parallel_size == 1
                assert not any(running(pid) for pid in new_pids)
                await trio.sleep(0.3)
                stop.set()  # no more requests; those running finish
            assert load.failed == []
            assert sorted(load.done) == list(range(load.sent))
            on_new = sorted(t for t, e in load.routed if e == 1)
            assert on_new and on_new[0] - ready_at < 1.0  # the new engine takes requests within 1 s of being ready
    assert await wait_no_children() == []


async def test_a_departing_engine_takes_no_new_request_and_its_requests_finish_or_end_after_the_drain(fake_config):
    config = fake_config(data_parallel_size=2)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            routed: list[int] = []
            engine.add_request_observer(lambda m: routed.append(m.engine_index))
            pids = [engine.engine_infos[1].engine_pid, *engine.engine_infos[1].worker_pids]
            ends: dict[str, object] = {}

            async def on_engine(index: int, name: str, params: SamplingParams) -> None:
                try:
                    ends[name] = (await engine.generate([9, 9], params, engine_index=index)).token_ids
                except EngineDeadError as exc:
                    ends[name] = exc

            async with trio.open_nursery() as nursery:
                for i in range(4):  # engine 0 the more loaded: only the departure keeps engine 1 from new requests
                    nursery.start_soon(on_engine, 0, f"busy-{i}", SamplingParams(max_tokens=120))
                nursery.start_soon(on_engine, 1, "short", SamplingParams(max_tokens=40))  # ~0.4 s: it drains
                nursery.start_soon(on_engine, 1, "endless", SamplingParams(max_tokens=100_000, ignore_eos=True))
                while engine.num_requests_in_flight() < 6:
                    await trio.sleep(0.01)
                nursery.start_soon(functools.partial(engine.scale, 1, drain_timeout_s=1.5))
                while not engine.is_scaling:
                    await trio.sleep(0.01)
                with pytest.raises(InvalidRequestError, match=r"engine_index: engine-core-1 is being removed"):
                    await engine.generate([5], SamplingParams(max_tokens=2), engine_index=1)
                routed.clear()
                outputs = [(await engine.generate([5, i], SamplingParams(max_tokens=3))).token_ids for i in range(6)]
                assert outputs == [fake_tokens([5, i], 3) for i in range(6)]
                assert routed == [0] * 6  # none to the departing engine, though it had fewer requests
            assert ends["short"] == fake_tokens([9, 9], 40)
            assert [ends[f"busy-{i}"] for i in range(4)] == [fake_tokens([9, 9], 120)] * 4
            assert isinstance(ends["endless"], EngineDeadError)
            assert "engine-core-1 was removed (the engines scaled to 1) before the request ended" in str(
                ends["endless"]
            )
            assert "drain_timeout_s=1.5" in str(ends["endless"])
            assert engine.engine_healths == ["ready"] and len(engine.engine_infos) == 1
            assert not [p for p in pids if running(p)]
    assert await wait_no_children() == []


async def test_a_departing_engine_killed_in_its_drain_has_its_requests_resumed_and_one_asking_for_it_ends(
    fake_config,
):
    """A request on a departing engine that dies goes on on an engine that
    stays (docs/supervision.md); one that asked for the departing engine
    ends naming why, and the group serves on."""
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(data_parallel_size=2)) as engine:
            outputs: dict[str, object] = {}
            long = SamplingParams(max_tokens=300, ignore_eos=True)

            async def run(name: str, index: int | None) -> None:
                try:
                    outputs[name] = await engine.generate([7, len(name)], long, engine_index=index)
                except EngineDeadError as exc:
                    outputs[name] = exc

            async with trio.open_nursery() as nursery:
                for name in ("busy-a", "busy-b", "busy-c"):
                    nursery.start_soon(run, name, 0)
                nursery.start_soon(run, "asked-for-1", 1)
                while engine.num_requests_in_flight() < 4:
                    await trio.sleep(0.01)
                nursery.start_soon(run, "free", None)  # the less loaded engine: 1
                while engine.num_requests_in_flight() < 5:
                    await trio.sleep(0.01)
                nursery.start_soon(functools.partial(engine.scale, 1, drain_timeout_s=30))
                while not engine.is_scaling:
                    await trio.sleep(0.01)
                psutil.Process(engine.engine_infos[1].engine_pid).kill()
            free = outputs["free"]
            assert isinstance(free, trioserve.RequestOutput) and free.num_resumes == 1
            assert free.token_ids == fake_tokens([7, 4], 300)
            assert isinstance(outputs["asked-for-1"], EngineDeadError)
            assert "engine-core-1 is being removed" in str(outputs["asked-for-1"])
            for name in ("busy-a", "busy-b", "busy-c"):
                assert outputs[name].token_ids == fake_tokens([7, len(name)], 300)  # type: ignore[union-attr]
            assert engine.engine_healths == ["ready"]
            assert (await engine.generate([5], SamplingParams(max_tokens=3))).token_ids == fake_tokens([5], 3)
    assert await wait_no_children() == []


async def test_a_scale_that_cannot_be_done_is_refused_naming_why_and_changes_nothing(fake_config, monkeypatch):
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config()) as engine:
            for size in (0, 65, True, 1.5):
                with pytest.raises(InvalidRequestError, match=r"^data_parallel_size: must be an integer in \[1, 64\]"):
                    await engine.scale(size)  # type: ignore[arg-type]
            for timeout in (-1, float("nan"), "5"):
                with pytest.raises(InvalidRequestError, match=r"^drain_timeout_s: must be a number of seconds >= 0"):
                    await engine.scale(2, drain_timeout_s=timeout)  # type: ignore[arg-type]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.scale, 2)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(ControlCallError, match=r"a scale to 2 engines is under way"):
                    await engine.scale(3)
            assert engine.engine_healths == ["ready", "ready"] and engine.config.data_parallel_size == 2

            # A new engine that cannot start: the scale fails naming it, and the group is as it was.
            from trioserve.errors import EngineStartupError
            from trioserve.frontend.engines.local import LocalProcessStrategy

            start = LocalProcessStrategy.start

            async def start_but_not_engine_2(self, client, nursery):  # type: ignore[no-untyped-def]
                if client.engine_index == 2:
                    raise EngineStartupError("no room here", stage="spawn", process=client.name)
                return await start(self, client, nursery)

            monkeypatch.setattr(LocalProcessStrategy, "start", start_but_not_engine_2)
            with pytest.raises(ControlCallError, match=r"scaling to 4 engines: .*no room here"):
                await engine.scale(4, drain_timeout_s=5)
            assert engine.engine_healths == ["ready", "ready"] and engine.config.data_parallel_size == 2
            assert not engine.is_scaling
            assert len(await run_concurrently(engine, [[5, i] for i in range(4)], SamplingParams(max_tokens=2))) == 4
    assert await wait_no_children() == []


def test_engines_on_other_hosts_or_several_api_servers_cannot_be_scaled_from_here(fake_config, tmp_path):
    from trioserve.frontend.engines.group import EngineGroup

    remote = fake_config(
        data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=5999, insecure_tcp=True
    )
    with pytest.raises(InvalidRequestError, match=r"engines on other hosts \(--headless\) join from their own hosts"):
        EngineGroup(remote).scaling.check(3, 10)
    group = EngineGroup(fake_config(), api_servers_dir=str(tmp_path))
    with pytest.raises(InvalidRequestError, match=r"cannot change with several API servers yet"):
        group.scaling.check(2, 10)


async def test_lockstep_engines_re_form_at_each_size_and_the_wave_number_never_goes_back(fake_config):
    params = SamplingParams(max_tokens=4)
    with trio.fail_after(90):
        async with trioserve.open_engine(config=fake_config(data_parallel_lockstep=True)) as engine:
            waves = engine._group.coordinator.waves
            assert waves is not None
            seen = [waves.wave]
            for size in (2, 1):
                prompts = [[6, i, size] for i in range(2 * size)]
                assert await run_concurrently(engine, prompts, params) == [fake_tokens(p, 4) for p in prompts]
                seen.append(engine._group.coordinator.waves.wave)  # type: ignore[union-attr]
                await engine.scale(size, drain_timeout_s=10)
                seen.append(engine._group.coordinator.waves.wave)  # type: ignore[union-attr]
                assert engine.engine_healths == ["ready"] * size
                by_index = [(await engine.generate([7, i], params, engine_index=i)).token_ids for i in range(size)]
                assert by_index == [fake_tokens([7, i], 4) for i in range(size)]
            assert seen == sorted(seen) and seen[-1] > seen[0], seen
    assert await wait_no_children() == []


@pytest.mark.model
async def test_a_tiny_models_outputs_while_scaling_1_2_1_equal_its_greedy_outputs_on_one_engine(tiny_model_dir):
    config = trioserve.EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, shutdown_grace_s=3.0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 40 + 3 * i, 7] for i in range(6)]
    with trio.fail_after(180):
        async with trioserve.open_engine(config=config) as engine:
            greedy = await run_concurrently(engine, prompts, params)  # one engine's
            routed: list[int] = []
            engine.add_request_observer(lambda m: routed.append(m.engine_index))
            outputs: list[tuple[int, list[int]]] = []
            stop = trio.Event()

            async def one(i: int) -> None:
                outputs.append((i, (await engine.generate(prompts[i], params)).token_ids))

            async def arrive(nursery: trio.Nursery) -> None:
                i = 0
                while not stop.is_set():
                    nursery.start_soon(one, i % len(prompts))
                    i += 1
                    with trio.move_on_after(0.2):
                        await stop.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive, nursery)
                await engine.scale(2, drain_timeout_s=60)
                while routed.count(1) < 3:  # the new engine serves
                    await trio.sleep(0.05)
                await engine.scale(1, drain_timeout_s=60)
                await trio.sleep(0.3)
                stop.set()
            assert engine.engine_healths == ["ready"]
            assert [tokens for i, tokens in outputs] == [greedy[i] for i, _ in outputs]
            assert set(routed) == {0, 1} and len(outputs) == len(routed)
    assert await wait_no_children() == []


async def test_scale_elastic_ep_over_http_behind_the_api_key_and_health_shows_the_engines(fake_config):
    bearer = {"Authorization": "Bearer sesame"}

    async def post(path: str, body: object, headers: dict[str, str] | None = bearer) -> tuple[int, dict]:
        status, _, answer = await in_thread(
            raw_request, server, "POST", path, json.dumps(body).encode(), headers=headers
        )
        return status, json.loads(answer)

    with trio.fail_after(60):
        async with serving(fake_config(), api_key="sesame") as server:
            assert (await in_thread(http_get, server.health_url))[1] == {"status": "ready"}
            assert (await post("/scale_elastic_ep", {"new_data_parallel_size": 2}, headers=None))[0] == 401
            for body, param in (
                ({"new_data_parallel_size": 0}, "new_data_parallel_size"),
                ({"new_data_parallel_size": "2"}, "new_data_parallel_size"),
                ({}, "new_data_parallel_size"),
                ({"new_data_parallel_size": 2, "drain_timeout": 0}, "drain_timeout"),
            ):
                status, answer = await post("/scale_elastic_ep", body)
                assert (status, answer["error"]["param"]) == (400, param), answer
            assert await post("/is_scaling_elastic_ep", {}) == (200, {"is_scaling_elastic_ep": False})
            status, answer = await post("/scale_elastic_ep", {"new_data_parallel_size": 2, "drain_timeout": 30})
            assert (status, answer) == (200, {"message": "Scaled to 2 data parallel engines"})
            health = (await in_thread(http_get, server.health_url))[1]
            assert health["engines"] == [{"engine": 0, "status": "ready"}, {"engine": 1, "status": "ready"}]
            metrics = (await in_thread(raw_request, server, "GET", "/metrics"))[2].decode()
            assert 'vllm:num_requests_running{engine="1"' in metrics
            assert (await post("/scale_elastic_ep", {"new_data_parallel_size": 1}))[0] == 200
            assert (await in_thread(http_get, server.health_url))[1] == {"status": "ready"}


async def test_a_new_engine_serves_the_adapters_added_while_serving_and_is_paused_as_the_others(fake_config, tmp_path):
    adapter = tmp_path / "late"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 6, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")  # (the fake runner reads only the config)
    with_lora = SamplingParams(max_tokens=4, lora="late")
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(enable_lora=True)) as engine:
            await engine.add_lora("late", str(adapter))
            want = (await engine.generate([5, 6], with_lora)).token_ids
            await engine.pause()
            await engine.scale(2, drain_timeout_s=10)
            assert engine.engine_healths == ["paused", "paused"]
            await engine.resume()
            assert engine.engine_healths == ["ready", "ready"]
            assert (await engine.generate([5, 6], with_lora, engine_index=1)).token_ids == want
            assert [i.name for i in await engine.list_loras()] == ["late"]
    assert await wait_no_children() == []
