"""Engine cores placed by Ray (``--data-parallel-backend ray``): each in an
actor of its own placement group, joining the front-end like an engine on
another host; supervised across Ray; nothing left behind, whoever dies.

The tests share one Ray cluster (``ray start --head`` in a process group of
this module's), to which this test process is connected too, to look at
placement groups and actors as Ray sees them; one test starts the local
cluster the front-end makes when given no address."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import trio
from helpers.fakes import fake_tokens
from helpers.reference import make_prompts, reference_greedy
from helpers.serving import free_port, left_running, serve_argv, spawned, tree_of, wait_for_url, wait_gone

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.errors import EngineDeadError, EngineStartupError

# ``ray start`` makes clusters that want Ray's token, which a driver sends only in this mode, read when
# Ray is imported (the front-end sets it so too).
os.environ.setdefault("RAY_AUTH_MODE", "token")
# The shared cluster's token, in this process's environment (its ``ray start`` and the front-ends it
# spawns inherit it): a fresh machine has no ~/.ray/auth_token.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
ray = pytest.importorskip("ray")  # the ray extra (scripts/setup.sh installs it)

MAX_TOKENS = 8
_HEAD: list[int] = []  # the shared cluster's ``ray start`` (its processes are its descendants)


def _ray_start(port: int, temp_dir: str) -> list[str]:
    ports = ("dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export", "node-manager")
    return [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=8",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        *(f"--{name}-port={free_port()}" for name in ports),
    ]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A Ray cluster for this module's tests, this process connected to it."""
    temp_dir = tempfile.mkdtemp(prefix="ray-tests-", dir="/tmp")  # (Ray's socket paths must be short)
    port = free_port()
    head = subprocess.Popen(
        _ray_start(port, temp_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    _HEAD[:] = [head.pid]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
                break
            except (ConnectionError, RuntimeError):
                assert time.monotonic() < deadline, "the test's Ray cluster did not start"
                time.sleep(1)
        yield address
    finally:
        ray.shutdown()
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(wait)
                break
            except subprocess.TimeoutExpired:
                pass
        head.wait(5)
        shutil.rmtree(temp_dir, ignore_errors=True)


def trioserve_groups() -> dict[str, str]:
    """This cluster's trioserve placement groups: name -> state (CREATED, REMOVED, PENDING...)."""
    from ray.util import placement_group_table

    return {
        group["name"]: group["state"]
        for group in placement_group_table().values()
        if group["name"].startswith("trioserve-")
    }


def parent_of(pid: int) -> int:
    return psutil.Process(pid).ppid()


def engine_core_pids(stats: Any) -> list[int]:
    """Each engine's engine-core pid: its workers' parent."""
    return [parent_of(engine.workers[0].pid) for engine in stats.engines]


def is_ray_actor(pid: int) -> bool:
    """A Ray worker process running our actor (Ray names the process after it)."""
    try:
        process = psutil.Process(pid)
        return "EngineCoreActor" in " ".join(process.cmdline()) or "EngineCoreActor" in process.name()
    except psutil.NoSuchProcess:
        return False


async def test_two_engines_on_ray_give_the_greedy_tokens_of_transformers_and_leave_nothing(ray_address, tiny_model_dir):
    """16 concurrent greedy requests over two engine cores placed by Ray, each
    in a Ray actor of its own placement group; after shutdown no actor,
    placement group or engine process of theirs is left."""
    model_dir = tiny_model_dir("llama")
    from trioserve.gpu.tiny_models import VOCAB_SIZE

    prompts = make_prompts(VOCAB_SIZE)
    prompts = [prompts[i % len(prompts)][: 3 + i] for i in range(16)]
    config = EngineConfig(
        model=str(model_dir),
        block_size=4,
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_address=ray_address,
        shutdown_grace_s=3.0,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with trio.fail_after(240):
        expected = await trio.to_thread.run_sync(reference_greedy, model_dir, prompts, MAX_TOKENS)
        before = set(trioserve_groups())
        async with trioserve.open_engine(config=config) as engine:
            outputs: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                outputs[i] = (await engine.generate(prompts[i], params)).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            assert [outputs[i] for i in range(len(prompts))] == expected
            stats = await engine.stats()
            assert all(engine_stats.num_requests > 0 for engine_stats in stats.engines)  # both served
            cores = engine_core_pids(stats)
            actors = [parent_of(pid) for pid in cores]
            assert all(is_ray_actor(pid) for pid in actors), [psutil.Process(p).cmdline() for p in actors]
            groups = {name: state for name, state in trioserve_groups().items() if name not in before}
            assert sorted(groups.values()) == ["CREATED", "CREATED"], groups
            workers = [w.pid for e in stats.engines for w in e.workers]
        left = [pid for pid in [*cores, *actors, *workers] if psutil.pid_exists(pid)]
        assert await trio.to_thread.run_sync(wait_gone, left, time.monotonic(), 10.0) < 10.0
        assert {trioserve_groups()[name] for name in groups} == {"REMOVED"}


async def test_kill_9_of_an_engine_actor_ends_its_requests_and_it_comes_back_in_a_new_placement_group(
    ray_address, fake_config
):
    """With resumption off, as a client of a dead engine would see it: its
    requests end with ``engine_dead`` at once, the other engine's complete,
    and the dead one serves again from a new placement group."""
    config = fake_config(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_address=ray_address,
        resume_requests=False,
        step_delay_s=0.02,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=5.0,
    )
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            ends: dict[int, str] = {}

            async def one(i: int) -> None:
                try:
                    await engine.generate([5, 6, 7 + i], params)
                    ends[i] = "done"
                except EngineDeadError:
                    ends[i] = "engine_dead"

            stats = await engine.stats()
            actor = parent_of(engine_core_pids(stats)[0])
            groups_before = trioserve_groups()
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
                await trio.sleep(1.0)
                killed_at = trio.current_time()
                os.kill(actor, signal.SIGKILL)
                while len([e for e in ends.values() if e == "engine_dead"]) < 1:
                    await trio.sleep(0.05)
                dead_after = trio.current_time() - killed_at
            assert dead_after < 2.0  # the actor's end is seen at once, not after the 5 s heartbeat deadline
            assert set(ends.values()) == {"done", "engine_dead"} and len(ends) == 8
            # Engine 0 back: a request that asks for it waits for it (within restart_wait_s) and is served.
            again = await engine.generate(
                [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), engine_index=0
            )
            assert len(again.token_ids) == 4
            assert parent_of(engine_core_pids(await engine.stats())[0]) != actor
            new = {name for name, state in trioserve_groups().items() if state == "CREATED"} - set(groups_before)
            assert len(new) == 1 and "-engine-0-" in next(iter(new)), trioserve_groups()
            old = [name for name in groups_before if "-engine-0-" in name and groups_before[name] == "CREATED"]
            assert [trioserve_groups()[name] for name in old] == ["REMOVED"]


@pytest.mark.parametrize("cluster", ["shared", "local"])
def test_kill_9_of_the_front_end_leaves_no_engine_process_and_no_placement_group(ray_address, tiny_model_dir, cluster):
    """``trioserve serve --data-parallel-backend ray`` killed with SIGKILL:
    Ray ends its dead driver's actors (and so their engine cores and
    workers) and removes its placement groups; a local cluster it started
    goes with it (its head's supervisor kills the cluster's process group)."""
    address = ["--ray-address", ray_address] if cluster == "shared" else []
    argv = serve_argv(
        "--model", str(tiny_model_dir("llama")), "--runner", "fake", "-dp", "2", "--data-parallel-backend", "ray",
        *address,
    )  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ""}
    with spawned(argv, env) as proc:
        wait_for_url(proc, timeout=150)
        tree = tree_of(proc.pid)
        mine = [pid for pid in tree if pid != proc.pid]
        if cluster == "shared":  # the actors are the shared cluster's processes, not the front-end's children
            mine += [pid for pid in tree_of(_HEAD[0]) if is_ray_actor(pid)]
            created = {n for n, s in trioserve_groups().items() if s == "CREATED"}
            assert len(created) >= 2
        killed_at = time.monotonic()
        proc.kill()
        proc.wait(5)
        assert wait_gone(mine, killed_at, 10.0) < 10.0
        if cluster == "shared":
            deadline = time.monotonic() + 10
            while any(trioserve_groups()[n] != "REMOVED" for n in created):
                assert time.monotonic() < deadline, trioserve_groups()
                time.sleep(0.2)


async def test_engines_on_ray_scale_1_2_1_under_load_losing_no_request_and_the_removed_ones_group_goes(
    ray_address, fake_config
):
    """The new engine core is placed by Ray and takes requests once ready; the
    departing one drains, then its actor and placement group are gone."""
    config = fake_config(data_parallel_backend="ray", ray_address=ray_address, step_delay_s=0.01)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            routed: list[int] = []
            engine.add_request_observer(lambda m: routed.append(m.engine_index))
            done: list[int] = []
            stop = trio.Event()

            async def one(i: int) -> None:
                prompt = [5, 6, 7 + i % 50]
                done.append((await engine.generate(prompt, params)).token_ids == fake_tokens(prompt, 20))

            async def arrive(nursery: trio.Nursery) -> None:
                i = 0
                while not stop.is_set():
                    nursery.start_soon(one, i)
                    i += 1
                    with trio.move_on_after(0.05):
                        await stop.wait()

            before = set(trioserve_groups())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive, nursery)
                await engine.scale(2, drain_timeout_s=60)
                ready_at = trio.current_time()
                while routed.count(1) < 3:
                    await trio.sleep(0.02)
                assert trio.current_time() - ready_at < 1.0  # the new engine takes requests at once
                added = {n for n, s in trioserve_groups().items() if s == "CREATED" and n not in before}
                assert len(added) == 1 and "-engine-1-" in next(iter(added))
                actor = parent_of(engine_core_pids(await engine.stats())[1])
                assert is_ray_actor(actor)
                await engine.scale(1, drain_timeout_s=60)
                stop.set()
            assert engine.engine_healths == ["ready"]
            assert all(done) and len(done) == len(routed) and set(routed) == {0, 1}  # each its tokens on one engine
            assert trioserve_groups()[next(iter(added))] == "REMOVED"
            # ``ray.kill`` returns once Ray has the actor dead; its raylet ends the process after.
            assert await trio.to_thread.run_sync(left_running, [actor], 10.0) == []


async def test_an_address_where_no_cluster_listens_fails_the_start_at_once_naming_it(fake_config):
    """Ray's own connect retries for minutes: the address is tried first."""
    address = f"127.0.0.1:{free_port()}"
    with trio.fail_after(20):
        started = trio.current_time()
        with pytest.raises(
            EngineStartupError, match=f"cannot connect to the Ray cluster at {address}: nothing listens"
        ):
            async with trioserve.open_engine(config=fake_config(data_parallel_backend="ray", ray_address=address)):
                pass
        assert trio.current_time() - started < 5.0
