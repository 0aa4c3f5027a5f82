"""``serve --api-server-count 2``: a supervising process, two API-server
processes on one port, the engine core (docs/deployment.md). Real processes,
the fake runner, the command as an operator runs it."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import ExitStack
from typing import Any

import msgspec
import psutil
import pytest
import trio
from helpers.fakes import fake_tokens
from helpers.serving import running, serve_argv, spawned, tree_of, wait_for_url, wait_gone
from websockets.exceptions import ConnectionClosed

from test_server import Received, collect, generate, in_thread, open_ws
from trioserve.server.api_servers import API_SERVER_ENV, ApiServerInit


def api_servers(pid: int) -> list[int]:
    """The API-server processes under the supervising process ``pid``."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            if p.cmdline()[-2:] == ["-m", "trioserve.server"] and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def argv(model: str, *options: str) -> list[str]:
    return serve_argv("--model", model, "--runner", "fake", "--api-server-count", "2", *options)


async def wait_until(predicate: Any, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def open_on_both(stack: ExitStack, url: str, pids: list[int], timeout: float = 30) -> list[Any]:
    """One WebSocket held by each API server in ``pids`` (closed with ``stack``),
    opening (and closing again) connections until each has taken one."""
    port = port_of(url)
    kept: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with ExitStack() as attempt:
            ws = attempt.enter_context(open_ws(url))
            pid = owner(ws, pids, port)
            if pid not in kept:
                kept[pid] = ws
                stack.push(attempt.pop_all())
        if len(kept) == len(pids):
            return list(kept.values())
        time.sleep(0.02)
    raise AssertionError(f"the connections never reached every API server: {sorted(kept)} of {pids}")


def owner(ws: Any, pids: list[int], port: int) -> int:
    """The API server holding ``ws``'s connection."""
    local = ws.socket.getsockname()[1]
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port == local:
                return pid
    raise AssertionError("no API server holds this connection")


def stream_on(ws: Any, prompts: dict[str, list[int]], **params: Any) -> dict[str, Received]:
    for request_id, prompt in prompts.items():
        ws.send(generate(request_id, prompt, **params))
    received, others = collect(ws, set(prompts))
    assert not others, others
    return received


@pytest.mark.parametrize("engines", ["1", "2"])
async def test_two_api_servers_share_the_port_and_stream_the_runners_greedy_tokens(tiny_model_dir, engines):
    model = str(tiny_model_dir("llama"))
    with trio.fail_after(90), spawned(argv(model, "--data-parallel-size", engines)) as proc:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        assert len(pids) == 2
        with ExitStack() as stack:
            sockets = await in_thread(open_on_both, stack, url, pids)
            prompts = {f"r{i}": [3 + i, 40 + i, 7] for i in range(4)}
            for ws in sockets:
                received = await in_thread(stream_on, ws, prompts, max_tokens=12, ignore_eos=True)
                for request_id, prompt in prompts.items():
                    assert received[request_id].token_ids == fake_tokens(prompt, 12)
                    assert received[request_id].terminal["type"] == "done"  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        tree = [proc.pid, *tree_of(proc.pid)]
        assert await in_thread(proc.wait, 20) == 0
        assert not any(running(pid) for pid in tree)


def stream_until_closed(ws: Any) -> str:
    """Send a long request on ``ws``; how its stream ended."""
    ws.send(generate("long", [5, 6], max_tokens=100_000, ignore_eos=True))
    try:
        while True:
            msg = json.loads(ws.recv(timeout=30))
            if msg["type"] != "delta":
                return msg["type"]
    except ConnectionClosed:
        return "closed"


async def test_kill_9_of_one_api_server_drops_only_its_connections_and_it_is_restarted(tiny_model_dir):
    options = ("--fake-options", '{"step_delay_s": 0.01}')
    with trio.fail_after(120), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        port = port_of(url)
        stack = ExitStack()
        sockets = await in_thread(open_on_both, stack, url, pids)
        owners = [await in_thread(owner, ws, pids, port) for ws in sockets]
        victim, survivor = owners[-1], next(pid for pid in pids if pid != owners[-1])
        doomed = next(ws for ws, pid in zip(sockets, owners, strict=True) if pid == victim)
        spared = next(ws for ws, pid in zip(sockets, owners, strict=True) if pid == survivor)
        outcome: dict[str, str | dict[str, Received]] = {}
        try:
            async with trio.open_nursery() as nursery:

                async def doomed_stream() -> None:
                    outcome["doomed"] = await in_thread(stream_until_closed, doomed)

                async def spared_streams() -> None:
                    prompts = {f"s{i}": [9, i] for i in range(3)}
                    outcome["spared"] = await in_thread(stream_on, spared, prompts, max_tokens=150, ignore_eos=True)

                nursery.start_soon(doomed_stream)
                nursery.start_soon(spared_streams)
                await trio.sleep(0.5)  # both streaming
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
            assert outcome["doomed"] == "closed"
            spared_received = outcome["spared"]
            assert isinstance(spared_received, dict)
            for r in spared_received.values():
                assert r.terminal is not None and r.terminal["type"] == "done" and len(r.token_ids) == 150
            # Restarted: a new API server takes the victim's place and serves.
            await wait_until(lambda: len(api_servers(proc.pid)) == 2 and victim not in api_servers(proc.pid), 20)
            restarted_after = time.monotonic() - killed_at
            assert restarted_after < 20
            fresh = await in_thread(open_on_both, stack, url, api_servers(proc.pid))
            for ws in fresh:
                received = await in_thread(stream_on, ws, {"x": [11, 12]}, max_tokens=5, ignore_eos=True)
                assert received["x"].token_ids == fake_tokens([11, 12], 5)
        finally:
            stack.close()
        tree = [proc.pid, *tree_of(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0
        assert not any(running(pid) for pid in tree)


async def test_kill_9_of_the_supervising_process_leaves_no_process_after_2s(tiny_model_dir):
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")))) as proc:
        await in_thread(wait_for_url, proc, 60)
        tree = tree_of(proc.pid)
        assert len(tree) >= 4  # two API servers, an engine core, its worker
        directory = api_servers_directory(api_servers(proc.pid)[0])
        assert os.path.isdir(directory)
        os.kill(proc.pid, signal.SIGKILL)
        gone_after = await in_thread(wait_gone, tree, time.monotonic(), 10)
        assert gone_after <= 2.0, f"the tree took {gone_after:.2f}s to go"
        assert not os.path.exists(directory)  # the private directory went with them


def api_servers_directory(pid: int) -> str:
    """The private directory where the engine cores listen for the API servers, as API server ``pid`` was told."""
    raw = psutil.Process(pid).environ()[API_SERVER_ENV]
    return msgspec.msgpack.decode(bytes.fromhex(raw), type=ApiServerInit).directory


@pytest.mark.parametrize("count", ["0", "-1"])
def test_api_server_count_below_1_is_a_usage_error(count, tiny_model_dir):
    from trioserve.cli import EXIT_USAGE, main

    model = str(tiny_model_dir("llama"))
    assert main(["serve", "--model", model, "--runner", "fake", "--api-server-count", count]) == EXIT_USAGE


def engine_cores(pid: int) -> list[int]:
    """The engine-core processes under the supervising process ``pid``."""
    return [
        p.pid
        for p in psutil.Process(pid).children()
        if p.cmdline()[-1:] == ["engine-core"] and p.status() != psutil.STATUS_ZOMBIE
    ]


async def test_kill_9_of_the_engine_core_ends_every_api_servers_streams_at_once_and_both_reattach(tiny_model_dir):
    options = ("--fake-options", '{"step_delay_s": 0.01}')
    with trio.fail_after(120), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        sockets = await in_thread(open_on_both, stack, url, api_servers(proc.pid))
        ends: list[str] = []
        (engine,) = engine_cores(proc.pid)
        async with trio.open_nursery() as nursery:

            async def one(ws: Any) -> None:
                ws.send(generate("long", [5, 6], max_tokens=100_000, ignore_eos=True))
                while (msg := json.loads(await in_thread(ws.recv, 30)))["type"] == "delta":
                    pass
                ends.append(msg["code"])

            for ws in sockets:
                nursery.start_soon(one, ws)
            await trio.sleep(0.5)
            os.kill(engine, signal.SIGKILL)
            killed_at = time.monotonic()
        assert ends == ["engine_dead"] * len(sockets)
        assert time.monotonic() - killed_at < 2.0  # not the heartbeat timeout: the connection's end tells
        for ws in sockets:  # the restarted engine core serves every API server
            received = await in_thread(stream_on, ws, {"x": [11, 12]}, max_tokens=5, ignore_eos=True)
            assert received["x"].token_ids == fake_tokens([11, 12], 5)
        assert engine_cores(proc.pid) != [engine]


def stream_to_close(ws: Any, started: Any) -> tuple[str, int | None]:
    """A long request on ``ws`` until the server closes it: how its stream
    ended (``done`` or the error's code), and the close code."""
    ws.send(generate("long", [5, 6], max_tokens=100_000, ignore_eos=True))
    assert json.loads(ws.recv(timeout=30))["type"] == "delta"
    started()
    while (msg := json.loads(ws.recv(timeout=30)))["type"] == "delta":
        pass
    end = msg["type"] if msg["type"] == "done" else msg["code"]
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=10)
    return end, info.value.rcvd.code if info.value.rcvd else None


async def test_sigterm_drains_every_api_servers_streams_then_exits_0_leaving_nothing(tiny_model_dir):
    grace = 1.0
    options = ("--fake-options", '{"step_delay_s": 0.01}', "--shutdown-grace", str(grace))
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        sockets = await in_thread(open_on_both, stack, url, pids)
        streaming = trio.Semaphore(0)
        ends: list[tuple[str, int | None]] = []
        async with trio.open_nursery() as nursery:

            async def one(ws: Any) -> None:
                def started() -> None:
                    trio.from_thread.run_sync(streaming.release)

                ends.append(await in_thread(stream_to_close, ws, started))

            for ws in sockets:
                nursery.start_soon(one, ws)
            for _ in sockets:
                await streaming.acquire()
            tree = [proc.pid, *tree_of(proc.pid)]
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        assert ends == [("shutdown", 1001)] * len(sockets)
        assert await in_thread(proc.wait, grace + 15) == 0
        gone_after = await in_thread(wait_gone, tree, signalled, grace + 15)
        assert gone_after < grace + 5, f"{gone_after:.2f}s"


async def test_the_usual_exit_codes_hold_3_when_the_engine_cannot_start(tiny_model_dir):
    options = ("--fake-options", '{"hang_at_load": true}', "--model-load-timeout", "1")
    with trio.fail_after(60), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        assert await in_thread(proc.wait, 45) == 3
        assert "model-load" in (proc.stderr.read() if proc.stderr else "")


async def test_the_usual_exit_codes_hold_4_when_the_engine_is_out_of_restarts(tiny_model_dir):
    options = ("--fake-options", '{"die_at_step": 2}', "--max-restarts", "0")
    with trio.fail_after(60), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = await in_thread(wait_for_url, proc, 45)
        tree = [proc.pid, *tree_of(proc.pid)]
        with open_ws(url) as ws:
            ws.send(generate("a", [5, 6], max_tokens=10, ignore_eos=True))
            while (msg := json.loads(await in_thread(ws.recv, 10)))["type"] == "delta":
                pass
            assert msg["code"] == "engine_dead"
        assert await in_thread(proc.wait, 30) == 4
        assert not any(running(pid) for pid in tree)
