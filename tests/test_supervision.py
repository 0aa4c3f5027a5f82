"""Supervision (docs/supervision.md): faults under load, restarts, the
restart budget, deadlines and exit codes, with real processes and the
torch-free fake runner."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio
from helpers.concurrent import Outcome, assert_idle_and_clean, consume
from helpers.fakes import RESTARTING, children, wait_no_children
from helpers.serving import left_running

import trioserve
from trioserve import SamplingParams
from trioserve.errors import EngineDeadError

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.fake_config(**RESTARTING)


@pytest.mark.parametrize("victim", ["worker", "engine-core"])
async def test_kill_9_under_load_ends_every_request_within_a_second_then_the_restarted_engine_serves(
    fake_config, victim
):
    with trio.fail_after(30):
        # A long grace: the restart must not wait for it (it is only for an
        # engine core that reports its death and then does not exit). Requests
        # are not resumed here (test_resumption.py: they are by default).
        config = fake_config(step_delay_s=0.01, shutdown_grace_s=20.0, resume_requests=False)
        async with trioserve.open_engine(config=config) as engine:
            old = engine.info
            outcomes = [Outcome() for _ in range(8)]
            async with trio.open_nursery() as nursery:
                for i, outcome in enumerate(outcomes):
                    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
                    nursery.start_soon(consume, engine, [3 + i, 4, 5], params, outcome)
                for outcome in outcomes:
                    await outcome.started.wait()
                pid = old.worker_pids[0] if victim == "worker" else old.engine_pid
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            for outcome in outcomes:
                assert isinstance(outcome.error, EngineDeadError), outcome.finish_reason
                assert outcome.ended_at is not None and outcome.ended_at - killed_at < 1.0
            assert engine.num_requests_in_flight() == 0
            await engine.wait_ready()
            assert time.monotonic() - killed_at < config.shutdown_grace_s / 2

            out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4))
            assert out.finish_reason == "length" and len(out.token_ids) == 4
            assert engine.health == "ready"
            assert engine.num_restarts == 1
            assert engine.info.engine_pid != old.engine_pid
            assert not set(engine.info.worker_pids) & set(old.worker_pids)
            # Only the new engine's processes are left.
            assert {p.pid for p in children()} == {engine.info.engine_pid, *engine.info.worker_pids}
            await assert_idle_and_clean(engine)
        assert await wait_no_children() == []


async def test_a_hung_worker_fails_its_step_at_the_deadline_and_the_engine_restarts(fake_config):
    config = fake_config(hang_at_step=3, step_timeout_s=0.5, resume_requests=False)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="step_timeout_s"):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=10))
            assert time.monotonic() - started < 3
            # The new worker counts its steps from 1 again: it hangs at its third step too.
            out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
            assert len(out.token_ids) == 2
            assert engine.num_restarts == 1
        assert await wait_no_children() == []


async def test_out_of_restarts_every_request_fails_at_once_and_wait_failed_returns(fake_config):
    config = fake_config(raise_at_step=2, max_restarts=2)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            for _ in range(3):  # the first death, then one per restart
                with pytest.raises(EngineDeadError, match="worker-0"):
                    await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            with trio.fail_after(5):
                failure = await engine.wait_failed()
            assert "max_restarts=2" in str(failure)
            assert engine.health == "failed"
            assert engine.num_restarts == 2
            with pytest.raises(EngineDeadError, match="max_restarts=2"):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            assert await wait_no_children() == []  # a failed engine holds no process
        assert await wait_no_children() == []


async def test_a_new_request_waits_a_bounded_time_for_a_restarting_engine(fake_config):
    config = fake_config(raise_at_step=2, restart_backoff_s=5.0, restart_wait_s=0.3)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            with pytest.raises(EngineDeadError):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            assert engine.health == "restarting"
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"restart_wait_s=0\.3"):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            assert 0.25 < time.monotonic() - started < 2
        assert await wait_no_children() == []


async def test_shutdown_while_restarting_leaves_no_process(fake_config):
    # Not resumed: the first death ends the request (a resumed one would die twice more).
    config = fake_config(raise_at_step=2, restart_backoff_s=0.2, resume_requests=False)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            old = {engine.info.engine_pid, *engine.info.worker_pids}
            with pytest.raises(EngineDeadError):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            while not {p.pid for p in children()} - old:  # the new engine core is starting
                await trio.sleep(0.01)
            assert engine.health == "restarting"
            exit_started = time.monotonic()
        assert time.monotonic() - exit_started < 2 * config.shutdown_grace_s
        assert await wait_no_children() == []
        assert engine.health == "stopped"


# --- cancellation at every point of a request's life -----------------------------


async def test_cancelled_while_waiting_for_a_restart_leaves_nothing(fake_config):
    # Not resumed: the first death ends the request (a resumed one would die twice more).
    config = fake_config(raise_at_step=2, restart_backoff_s=0.5, resume_requests=False)
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            with pytest.raises(EngineDeadError):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))
            with trio.move_on_after(0.1) as scope:
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=5))  # waits for the restart
            assert scope.cancelled_caught
            await engine.wait_ready()
            await assert_idle_and_clean(engine)


@pytest.mark.parametrize("when", ["before-submission", "prefill", "mid-decode", "consumer-stalled"])
async def test_a_request_cancelled_at_any_point_leaves_no_state(fake_config, when):
    # Slow steps so that "prefill" (the first step) and "mid-decode" can be hit.
    config = fake_config(step_delay_s=0.05)
    prompt = list(range(3, 40))
    with trio.fail_after(30):
        async with trioserve.open_engine(config=config) as engine:
            bystander = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, engine, [7, 8], SamplingParams(max_tokens=30, ignore_eos=True), bystander)
                with trio.CancelScope() as scope:
                    if when == "before-submission":
                        scope.cancel()
                    stream = engine.stream(prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
                    async with stream:
                        if when == "prefill":
                            nursery.start_soon(_cancel_after, scope, 0.01)  # inside the first step
                        elif when == "mid-decode":
                            await stream.__anext__()
                            await stream.__anext__()
                            scope.cancel()
                        async for _ in stream:
                            if when == "consumer-stalled":
                                await trio.sleep(0.5)  # outputs pile up (merged) meanwhile
                                scope.cancel()
                assert scope.cancelled_caught
            assert bystander.finish_reason == "length" and len(bystander.token_ids) == 30
            await assert_idle_and_clean(engine)


async def _cancel_after(scope: trio.CancelScope, delay: float) -> None:
    await trio.sleep(delay)
    scope.cancel()


# --- the command line: deadlines and exit codes ----------------------------------


def run_cli(argv: list[str], timeout: float) -> tuple[int, str, list[int]]:
    """Run ``trioserve`` with ``argv``; its exit status, stderr, and the pids of
    every process it started that still runs after it exited (``left_running``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trioserve.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.05)
        if proc.poll() is None:
            raise AssertionError(f"trioserve {' '.join(argv)} did not exit within {timeout}s")
        _, stderr = proc.communicate(timeout=5)
        return proc.returncode, stderr, left_running(seen)
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.communicate()


async def test_serve_with_a_model_load_that_hangs_exits_3_naming_the_stage(tiny_model_dir):
    argv = [
        "serve",
        "--port",
        "0",
        "--model",
        str(tiny_model_dir("llama")),
        "--runner",
        "fake",
        "--fake-options",
        json.dumps({"hang_at_load": True}),
        "--model-load-timeout",
        "1",
    ]
    code, stderr, left = await trio.to_thread.run_sync(run_cli, argv, 30)
    assert code == 3, stderr
    assert "model-load" in stderr and "model_load_timeout_s" in stderr
    assert left == []


async def test_generate_into_a_pipe_its_reader_closed_stops_quietly(tiny_model_dir):
    """``trioserve generate ... | head -c 10``: no traceback, exit 1, nothing left running."""
    argv = [sys.executable, "-m", "trioserve.cli", "generate", "Hi", "--model", str(tiny_model_dir("llama")),
            "--runner", "fake", "--max-tokens", "5000", "--ignore-eos",
            "--fake-options", json.dumps({"step_delay_s": 0.002})]  # fmt: skip

    def scenario() -> tuple[int, str, list[int]]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert proc.stdout is not None and proc.stdout.read(10)
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            proc.stdout.close()  # as head does once it has its 10 bytes
            code = proc.wait(timeout=30)
            assert proc.stderr is not None
            return code, proc.stderr.read(), left_running(tree)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    with trio.fail_after(60):
        code, stderr, left = await trio.to_thread.run_sync(scenario)
    assert (code, stderr, left) == (1, "", [])


async def test_serve_out_of_restarts_exits_4_and_leaves_no_process(tiny_model_dir):
    """The server's engine dies at its second step, again after its one restart:
    out of restarts, the server exits 4, with no process left behind."""
    from websockets.sync.client import connect

    argv = [
        sys.executable,
        "-m",
        "trioserve.cli",
        "serve",
        "--port",
        "0",
        "--model",
        str(tiny_model_dir("llama")),
        "--runner",
        "fake",
        "--fake-options",
        json.dumps({"raise_at_step": 2}),
        "--max-restarts",
        "1",
        "--no-resume-requests",
    ]

    def scenario() -> tuple[int, str, list[str], list[int]]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("trioserve: serving on "), line + proc.stderr.read()  # type: ignore[union-attr]
            url = line.split()[3]
            seen = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            codes = []
            with connect(url, open_timeout=10) as ws:
                for i in range(2):
                    ws.send(
                        json.dumps(
                            {
                                "type": "generate",
                                "id": f"r{i}",
                                "prompt_token_ids": [1, 2, 3],
                                "params": {"max_tokens": 5},
                            }
                        )
                    )
                    while True:
                        msg = json.loads(ws.recv(timeout=10))
                        if msg["type"] in ("done", "error"):
                            codes.append(msg.get("code", "done"))
                            break
                    if i == 0:
                        seen |= {p.pid for p in _wait_for_restart(proc.pid, seen)}
            code = proc.wait(timeout=15)
            stderr = proc.stderr.read() if proc.stderr else ""
            return code, stderr, codes, left_running(seen)
        finally:
            if proc.poll() is None:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    p.kill()
                proc.kill()
            proc.communicate()

    with trio.fail_after(60):
        code, stderr, codes, left = await trio.to_thread.run_sync(scenario)
    assert codes == ["engine_dead", "engine_dead"]
    assert code == 4, stderr
    assert "max_restarts=1" in stderr
    assert left == []


def _wait_for_restart(server_pid: int, old: set[int]) -> list[psutil.Process]:
    """The server's new engine processes, once its restart started them."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = [p for p in psutil.Process(server_pid).children(recursive=True) if p.pid not in old]
        if len(new) >= 2:
            return new
        time.sleep(0.05)
    raise AssertionError("the engine was not restarted")


async def test_a_worker_that_dies_while_the_front_end_stops_leaves_one_line_not_a_traceback(tiny_model_dir):
    """Found: ``trioserve generate`` whose worker dies (``die_at_step``) stops
    its engine at once; the engine core's stop then raced its failure, and
    the failure came out as a ``BaseExceptionGroup`` (a ``Cancelled`` beside
    the ``WorkerError``) that ``except Exception`` missed: a full traceback on
    stderr in about 4 runs of 5, where supervision.md promises one line.
    The request failed; the engine, with restarts left, was not out of them:
    exit 1 (4 is for an engine out of restarts)."""
    argv = ["generate", "hello", "--max-tokens", "20", "--model", str(tiny_model_dir("llama"))]
    argv += ["--runner", "fake", "--fake-options", json.dumps({"die_at_step": 5})]
    argv += ["--no-resume-requests"]  # the first death ends the request (resumed, it died thrice per run)
    for _ in range(3):
        code, stderr, left = await trio.to_thread.run_sync(run_cli, argv, 60)
        assert code == 1 and left == [], stderr
        assert "trioserve: RequestError: the request failed: engine-core-0 died" in stderr, stderr
        assert "Traceback" not in stderr, stderr
        assert "trioserve-engine-core (pid " in stderr and "exited with code 3 during step 5" in stderr, stderr
    code, stderr, left = await trio.to_thread.run_sync(run_cli, [*argv, "--max-restarts", "0"], 60)
    assert code == 4 and left == [] and "the engine died and was not recovered" in stderr, stderr
