"""Hangs are seen in seconds, and nothing is orphaned (docs/supervision.md,
"Hangs"): stopped (SIGSTOP) processes, steps far slower than measured, a
shutdown with a stopped worker, and kill -9 of the front-end. Real
processes, the torch-free fake runner."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from helpers.concurrent import Outcome, assert_idle_and_clean, consume
from helpers.fakes import RESTARTING, fake_tokens, wait_no_children
from helpers.server import Received, collect, generate, open_ws
from helpers.serving import running, serve_argv, spawned, tree_of, wait_for_url, wait_gone

import trioserve
from trioserve import SamplingParams
from trioserve.errors import EngineDeadError

FAST_BEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}


pytestmark = pytest.mark.fake_config(**RESTARTING)


async def run_until_hung(engine: trioserve.Engine, victim: str, n: int = 4) -> tuple[list[Outcome], float, set[str]]:
    """Stream ``n`` long requests, SIGSTOP the victim, and wait for them all
    to end; their outcomes, when the victim was stopped, and every health the
    engine reported meanwhile."""
    outcomes = [Outcome() for _ in range(n)]
    healths: set[str] = set()
    async with trio.open_nursery() as nursery:
        for i, outcome in enumerate(outcomes):
            params = SamplingParams(max_tokens=100_000, ignore_eos=True)
            nursery.start_soon(consume, engine, [3 + i, 4, 5], params, outcome)
        for outcome in outcomes:
            await outcome.started.wait()
        pid = engine.info.worker_pids[0] if victim == "worker" else engine.info.engine_pid
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while any(o.ended_at is None for o in outcomes):
            healths.add(engine.health)
            await trio.sleep(0.02)
    return outcomes, stopped_at, healths


@pytest.mark.parametrize("victim", ["worker", "engine-core"])
async def test_a_stopped_process_is_declared_hung_its_requests_end_and_the_engine_restarts(fake_config, victim):
    config = fake_config(step_delay_s=0.01, resume_requests=False, **FAST_BEATS)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            old = engine.info
            outcomes, stopped_at, healths = await run_until_hung(engine, victim)
            assert "stalled" in healths  # while the hang was suspected, before it was declared
            ended = [o.ended_at - stopped_at for o in outcomes if o.ended_at is not None]
            for outcome in outcomes:
                assert isinstance(outcome.error, EngineDeadError) and "hung" in str(outcome.error), outcome.error
            # Declared a heartbeat timeout after the last message heard (checked every half interval): that
            # message came before the SIGSTOP, about an interval before it at most (a heartbeat or an output
            # every step), or two on a busy machine (seen 3 ms past one); every request ends at once after.
            earliest = config.heartbeat_timeout_s - 2 * config.heartbeat_interval_s
            assert earliest <= min(ended) and max(ended) <= config.heartbeat_timeout_s + 2.0
            await engine.wait_ready()
            assert engine.num_restarts == 1 and engine.health == "ready"
            out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4))
            assert len(out.token_ids) == 4
            assert not any(running(pid) for pid in [old.engine_pid, *old.worker_pids])  # the stopped one too
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_with_the_default_heartbeats_a_stopped_worker_is_declared_hung_within_10_s(fake_config):
    config = fake_config(step_delay_s=0.01, resume_requests=False)
    with trio.fail_after(40):
        async with trioserve.open_engine(config=config) as engine:
            outcomes, stopped_at, _ = await run_until_hung(engine, "worker", n=2)
            for outcome in outcomes:
                assert isinstance(outcome.error, EngineDeadError)
                assert outcome.ended_at is not None and outcome.ended_at - stopped_at < 10.0
            await engine.wait_ready()
        assert await wait_no_children() == []


async def test_a_step_far_slower_than_measured_is_a_hang_long_before_the_step_timeout(fake_config):
    # step_timeout_s stays 300; not resumed: each life of the worker hangs at its step 30
    config = fake_config(step_delay_s=0.002, hang_at_step=30, step_hang_min_s=0.5, resume_requests=False)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="the slowest step of its size") as info:
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
            assert time.monotonic() - started < 5.0
            assert "step 30" in str(info.value) and "hung, killed" in str(info.value)
            await engine.wait_ready()
        assert await wait_no_children() == []


def worker_of(server_pid: int) -> int:
    """The pid of the server's one worker (its engine core's child)."""
    (worker,) = [p.pid for p in psutil.Process(server_pid).children(recursive=True) if p.ppid() != server_pid]
    return worker


def get_health(url: str) -> str:
    health_url = url.replace("ws://", "http://") + "/health"
    try:
        with urllib.request.urlopen(health_url, timeout=2) as response:
            return str(json.loads(response.read())["status"])
    except urllib.error.HTTPError as error:
        return str(json.loads(error.read())["status"])


async def test_health_says_stalled_then_the_server_restarts_the_stopped_engine(tiny_model_dir):
    argv = serve_argv(
        "--model", str(tiny_model_dir("llama")), "--runner", "fake",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
    )  # fmt: skip
    with trio.fail_after(60), spawned(argv) as proc:
        url = await trio.to_thread.run_sync(wait_for_url, proc, 30)
        assert await trio.to_thread.run_sync(get_health, url) == "ready"
        worker = worker_of(proc.pid)
        os.kill(worker, signal.SIGSTOP)
        seen = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not seen or seen[-1] != "ready" or "stalled" not in seen):
            seen.append(await trio.to_thread.run_sync(get_health, url))
            await trio.sleep(0.05)
        assert "stalled" in seen, seen
        assert seen[-1] == "ready" and not running(worker)
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 20) == 0


def stream_through_a_freeze(url: str, frozen: list[int], freeze_s: float) -> Received:
    """Stream a request of ~3 s; freeze ``frozen`` (SIGSTOP) for ``freeze_s`` once it streams, then thaw them."""
    with open_ws(url) as ws:
        ws.send(generate("r", [5, 6], max_tokens=300, ignore_eos=True))
        first, _ = collect_first(ws)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        received, _ = collect(ws, {"r"}, received={"r": first})
        return received["r"]


def collect_first(ws: Any) -> tuple[Received, dict]:
    """Read up to the request's first tokens."""
    while True:
        msg = json.loads(ws.recv(timeout=10))
        if msg["type"] == "delta":
            return Received(token_ids=list(msg["token_ids"])), msg
        assert msg["type"] not in ("done", "error"), msg


def fast_beats_server(tiny_model_dir: Any) -> list[str]:
    """``serve`` on the fake runner, with a heartbeat every 0.2 s and a 1 s timeout."""
    return serve_argv(
        "--model", str(tiny_model_dir("llama")), "--runner", "fake", "--fake-options", '{"step_delay_s": 0.01}',
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1",
    )  # fmt: skip


async def test_a_frozen_front_end_or_tree_is_not_taken_for_a_hung_engine_once_it_runs_again(tiny_model_dir):
    """SIGSTOP of the server alone, then of every process (``docker pause``), for
    three heartbeat timeouts: on SIGCONT each watchdog finds its own deadline
    past, but the time its process was away is not its peer's silence. Each
    time the stream ends in full and no process was replaced. (One server for
    both freezes: the first leaves it as it was, which the second checks.)"""
    argv = fast_beats_server(tiny_model_dir)
    with trio.fail_after(60), spawned(argv) as proc:
        url = await trio.to_thread.run_sync(wait_for_url, proc, 30)
        tree = tree_of(proc.pid)
        for frozen in ("front-end", "whole tree"):
            victims = [proc.pid] if frozen == "front-end" else [proc.pid, *tree]
            received = await trio.to_thread.run_sync(stream_through_a_freeze, url, victims, 3.0)
            assert received.terminal is not None and received.terminal["type"] == "done", (frozen, received.terminal)
            assert received.token_ids == fake_tokens([5, 6], 300), frozen
            assert tree_of(proc.pid) == tree, frozen  # the same engine core and worker: none was killed as hung
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 20) == 0


def stream_until_error(url: str, server: int, worker: int, freeze_s: float) -> dict[str, Any]:
    """Stream a long request; freeze the server and stop the worker, thaw the
    server alone after ``freeze_s``; the stream's terminal message."""
    with open_ws(url) as ws:
        ws.send(generate("r", [5, 6], max_tokens=100_000, ignore_eos=True))
        collect_first(ws)
        os.kill(server, signal.SIGSTOP)
        os.kill(worker, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.kill(server, signal.SIGCONT)
        received, _ = collect(ws, {"r"}, timeout=15)
        assert received["r"].terminal is not None
        return received["r"].terminal


async def test_a_worker_stopped_while_the_front_end_was_frozen_is_still_found_and_named(tiny_model_dir):
    """The front-end's own absence is excused, not the worker's: the engine
    core (which ran) kills it as hung, and the clients hear why from the
    engine core's death report, read before its exit code (found: "exited
    with code 1", the exit reaped first)."""
    argv = [*fast_beats_server(tiny_model_dir), "--no-resume-requests"]
    with trio.fail_after(60), spawned(argv) as proc:
        url = await trio.to_thread.run_sync(wait_for_url, proc, 30)
        worker = worker_of(proc.pid)
        terminal = await trio.to_thread.run_sync(stream_until_error, url, proc.pid, worker, 3.0)
        assert terminal["type"] == "error", terminal
        assert f"worker-0 (pid {worker}) sent nothing for" in terminal["message"], terminal
        assert not running(worker)
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 20) == 0


async def test_sigterm_with_a_stopped_worker_leaves_no_process(tiny_model_dir):
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake", "--shutdown-grace", "1")
    with trio.fail_after(60), spawned(argv) as proc:
        await trio.to_thread.run_sync(wait_for_url, proc, 30)
        tree = tree_of(proc.pid)
        assert len(tree) == 2  # the engine core and its worker
        os.kill(worker_of(proc.pid), signal.SIGSTOP)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0
        gone_after = await trio.to_thread.run_sync(wait_gone, [proc.pid, *tree], signalled, 10)
        assert not any(running(pid) for pid in tree), "a process outlived the server"
        assert gone_after < 10


LOCKSTEP_PAIR = ["--data-parallel-size", "2", "--data-parallel-lockstep"]


@pytest.mark.parametrize("extra", [[], LOCKSTEP_PAIR], ids=["one", "lockstep"])
async def test_kill_9_of_the_front_end_leaves_no_private_directory_and_no_process(
    tiny_model_dir, tmp_path: Path, extra: list[str]
):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake", *extra)
    with trio.fail_after(60), spawned(argv, env=env) as proc:
        await trio.to_thread.run_sync(wait_for_url, proc, 30)
        tree = tree_of(proc.pid)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("trioserve-")]
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() < killed_at + 2.0 and any(p.name.startswith("trioserve-") for p in tmp_path.iterdir()):
            await trio.sleep(0.02)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("trioserve-")] == []
        assert await trio.to_thread.run_sync(wait_gone, tree, killed_at, 2.0) < 2.0
