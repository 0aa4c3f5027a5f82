"""``serve --api-server-count 2``: a supervising process, two API-server
processes on one port, the engine core (docs/deployment.md). Real processes,
the fake runner, the command as an operator runs it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import trio
from helpers.fakes import fake_tokens
from helpers.server import Received, collect, generate, open_ws
from helpers.serving import (
    free_port,
    headless,
    headless_argv,
    kill_tree,
    running,
    serve_argv,
    spawned,
    tree_of,
    wait_for_url,
    wait_gone,
)
from helpers.waiting import in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed

from trioserve.api import Engine, open_attached_engine
from trioserve.server.api_servers.supervisor import API_SERVER_ENV, ApiServerInit
from trioserve.transport.curve import write_keys


def api_servers(pid: int) -> list[int]:
    """The API-server processes under the supervising process ``pid``."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            if p.cmdline()[-2:] == ["-m", "trioserve.server.api_servers"] and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def engine_cores(pid: int) -> list[int]:
    """The engine-core processes the supervising process ``pid`` runs now: a
    zombie (dead, not yet reaped) is not one, nor one gone while they are listed."""
    found = []
    for p in psutil.Process(pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # gone meanwhile (ZombieProcess is a NoSuchProcess)
            if p.cmdline()[-1:] == ["engine-core"] and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
    return found


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def argv(model: str, *options: str) -> list[str]:
    return serve_argv("--model", model, "--runner", "fake", "--api-server-count", "2", *options)


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


def http_on_both(stack: ExitStack, port: int, pids: list[int], timeout: float = 30) -> list[http.client.HTTPConnection]:
    """One kept-alive HTTP connection to each API server in ``pids``, in that order (closed with ``stack``)."""
    kept: dict[int, http.client.HTTPConnection] = {}
    deadline = time.monotonic() + timeout
    while len(kept) < len(pids) and time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")  # answered: accepted by an API server, not waiting in the queue
        conn.getresponse().read()
        pid = owner(conn, pids, port)
        if pid in kept:
            conn.close()
        else:
            kept[pid] = conn
            stack.callback(conn.close)
    assert len(kept) == len(pids), f"the connections never reached every API server: {sorted(kept)} of {pids}"
    return [kept[pid] for pid in pids]


def http_call(conn: http.client.HTTPConnection, method: str, path: str) -> tuple[int, dict]:
    conn.request(method, path)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def owner(ws: Any, pids: list[int], port: int) -> int:
    """The API server holding the connection of ``ws`` (a WebSocket, or an HTTPConnection)."""
    local = (ws.socket if hasattr(ws, "socket") else ws.sock).getsockname()[1]
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


def engine_load(url: str) -> tuple[float, float]:
    """Engine 0's running requests and KV-cache usage, as ``/metrics`` says."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port_of(url)}/metrics", timeout=5) as response:
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(response.read().decode())
            for sample in family.samples
            if sample.labels.get("engine") == "0"
        }
    return samples["vllm:num_requests_running"], samples["vllm:kv_cache_usage_perc"]


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


async def test_a_control_call_that_finds_an_engine_core_restarting_is_a_503_naming_it(tiny_model_dir):
    """An API server of several keeps no call for an engine core's next life
    (found: two of them each replayed their own, in no fixed order, and a
    pause through one then a resume through the other left it paused)."""
    options = ("--data-parallel-size", "2", "--fake-options", '{"load_delay_s": 2}')
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        (conn,) = (await in_thread(http_on_both, stack, port_of(url), api_servers(proc.pid)))[:1]
        os.kill(engine_cores(proc.pid)[0], signal.SIGKILL)
        await wait_until(lambda: "restarting" in json.dumps(http_call(conn, "GET", "/health")), 5)
        status, body = await in_thread(http_call, conn, "POST", "/v1/engine/pause")
        assert (status, body["error"]["code"]) == (503, "engine_restarting"), body
        assert re.search(r"engine-core-\d is restarting: Pause did not reach it", body["error"]["message"]), body
        assert (await in_thread(http_call, conn, "POST", "/v1/engine/resume"))[0] == 503
        ready = {"status": "ready", "engines": [{"engine": 0, "status": "ready"}, {"engine": 1, "status": "ready"}]}
        await wait_until(lambda: http_call(conn, "GET", "/health") == (200, ready), 20)  # nobody paused it again
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0


async def test_an_api_server_restarted_while_the_engine_is_paused_says_paused_from_its_start(tiny_model_dir):
    """Found: it said "ready" until the engine core's next heartbeat (its
    ``Attached`` now carries the engine core's state)."""
    options = ("--heartbeat-interval", "5", "--heartbeat-timeout", "20")
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        conn = (await in_thread(http_on_both, stack, port_of(url), pids))[0]
        assert await in_thread(http_call, conn, "POST", "/v1/engine/pause") == (200, {"health": "paused"})
        os.kill(pids[1], signal.SIGKILL)
        await wait_until(lambda: len(api_servers(proc.pid)) == 2 and pids[1] not in api_servers(proc.pid), 20)
        now = api_servers(proc.pid)
        new = (await in_thread(http_on_both, stack, port_of(url), now))[now.index(next(p for p in now if p != pids[0]))]
        assert await in_thread(http_call, new, "GET", "/health") == (503, {"status": "paused"})
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0


async def test_a_stopped_api_server_is_killed_as_hung_its_request_aborted_and_it_is_restarted(tiny_model_dir):
    """SIGSTOP (or a wedged event loop): its clients would wait for ever while
    the other API server says 200 on /health."""
    options = ("--fake-options", '{"step_delay_s": 0.01}', "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1")
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        sockets = await in_thread(open_on_both, stack, url, pids)
        victim = await in_thread(owner, sockets[0], pids, port_of(url))
        sockets[0].send(generate("long", [5, 6], max_tokens=100_000, ignore_eos=True))
        await wait_until(lambda: engine_load(url)[0] == 1.0, 10)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await wait_until(lambda: not running(victim), 10)
        assert time.monotonic() - stopped_at < 1 + 2  # the heartbeat timeout, and a margin
        with pytest.raises(ConnectionClosed):
            while True:
                await in_thread(sockets[0].recv, 5)
        await wait_until(lambda: engine_load(url) == (0.0, 0.0), 5)  # its request is aborted
        await wait_until(lambda: len(api_servers(proc.pid)) == 2, 20)  # and it is restarted
        assert victim not in api_servers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0
        assert proc.stderr is not None and "sent nothing for" in proc.stderr.read()


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


@pytest.mark.parametrize("count", ["0", "-1", "65", str(10**18)])  # (10**18 was a MemoryError, 400 processes ran)
def test_api_server_count_outside_1_to_64_is_a_usage_error(count, tiny_model_dir):
    from trioserve.cli import EXIT_USAGE, main

    model = str(tiny_model_dir("llama"))
    assert main(["serve", "--model", model, "--runner", "fake", "--api-server-count", count]) == EXIT_USAGE


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_port_in_use_is_named_in_one_line_and_exit_1(count, tiny_model_dir, capsys):
    """Also: ``main`` gives back the signal handlers it found. Found: the
    server's receiver left SIGTERM and SIGHUP ignored in this process, and
    every process a later test started inherited that."""
    import socket

    from trioserve.cli import EXIT_ERROR, main

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        options = ["--runner", "fake", "--api-server-count", count, "--port", port, "--startup-timeout", "30"]
        assert main(["serve", "--model", str(tiny_model_dir("llama")), *options]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"trioserve: cannot listen on 127.0.0.1:{port}:" in err and "Traceback" not in err, err
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers


async def one_api_server_killed(proc: Any, url: str) -> None:
    """kill -9 of one of ``proc``'s API servers, each holding a connection
    with requests streaming: only its connections drop, and its request is
    aborted in the engine; a new API server takes its place and serves."""
    pids = api_servers(proc.pid)
    port = port_of(url)
    with ExitStack() as stack:
        sockets = await in_thread(open_on_both, stack, url, pids)
        owners = [await in_thread(owner, ws, pids, port) for ws in sockets]
        victim, survivor = owners[-1], next(pid for pid in pids if pid != owners[-1])
        doomed = next(ws for ws, pid in zip(sockets, owners, strict=True) if pid == victim)
        spared = next(ws for ws, pid in zip(sockets, owners, strict=True) if pid == survivor)
        outcome: dict[str, str | dict[str, Received]] = {}
        async with trio.open_nursery() as nursery:

            async def doomed_stream() -> None:
                outcome["doomed"] = await in_thread(stream_until_closed, doomed)

            async def spared_streams() -> None:
                prompts = {f"s{i}": [9, i] for i in range(3)}
                outcome["spared"] = await in_thread(stream_on, spared, prompts, max_tokens=150, ignore_eos=True)

            nursery.start_soon(doomed_stream)
            nursery.start_soon(spared_streams)
            await wait_until(lambda: engine_load(url)[0] == 4, 10, "both connections' requests running")
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
        assert outcome["doomed"] == "closed"
        spared_received = outcome["spared"]
        assert isinstance(spared_received, dict)
        for r in spared_received.values():
            assert r.terminal is not None and r.terminal["type"] == "done" and len(r.token_ids) == 150
        # The victim's request (100,000 tokens) is aborted in the engine: its batch slot and KV blocks are free.
        await wait_until(lambda: engine_load(url) == (0.0, 0.0), 5)
        # Restarted: a new API server takes the victim's place and serves.
        await wait_until(lambda: len(api_servers(proc.pid)) == 2 and victim not in api_servers(proc.pid), 20)
        restarted_after = time.monotonic() - killed_at
        assert restarted_after < 20
        fresh = await in_thread(open_on_both, stack, url, api_servers(proc.pid))
        for ws in fresh:
            received = await in_thread(stream_on, ws, {"x": [11, 12]}, max_tokens=5, ignore_eos=True)
            assert received["x"].token_ids == fake_tokens([11, 12], 5)


async def engine_core_killed(proc: Any, url: str) -> None:
    """After a pause through one API server and a resume through the other,
    kill -9 of the engine core under a stream on each: each API server
    resumes its own once both reattach, and the new engine core serves both."""
    pids = api_servers(proc.pid)
    with ExitStack() as stack:
        sockets = await in_thread(open_on_both, stack, url, pids)
        # Paused through one API server, resumed through the other: each says what the engine core
        # says (found: each kept its own calls' state, so the first said "paused" for good, and
        # paused the engine core's next life again after a restart: every request then waited).
        a, b = await in_thread(http_on_both, stack, port_of(url), pids)
        assert (await in_thread(http_call, a, "POST", "/v1/engine/pause"))[0] == 200
        await wait_until(lambda: http_call(b, "GET", "/health") == (503, {"status": "paused"}), 5)
        assert (await in_thread(http_call, b, "POST", "/v1/engine/resume"))[0] == 200
        await wait_until(lambda: http_call(a, "GET", "/health") == (200, {"status": "ready"}), 5)
        ends: list[tuple[list[int], dict]] = []
        (engine,) = engine_cores(proc.pid)
        async with trio.open_nursery() as nursery:

            async def one(ws: Any) -> None:
                request = json.loads(generate("long", [5, 6], max_tokens=400, ignore_eos=True))
                ws.send(json.dumps({**request, "stream_options": {"include_resumes": True}}))
                tokens: list[int] = []
                while (msg := json.loads(await in_thread(ws.recv, 30)))["type"] == "delta":
                    tokens += msg["token_ids"]
                ends.append((tokens, msg))

            for ws in sockets:
                nursery.start_soon(one, ws)
            await wait_until(lambda: engine_load(url)[0] == len(sockets), 10, "every connection's request running")
            os.kill(engine, signal.SIGKILL)
        # Each API server resumed its own stream on the restarted engine core: whole, no token twice.
        for tokens, done in ends:
            assert done["type"] == "done" and done["num_resumes"] == 1, done
            assert tokens == fake_tokens([5, 6], 400)
        for ws in sockets:  # the restarted engine core serves every API server
            received = await in_thread(stream_on, ws, {"x": [11, 12]}, max_tokens=5, ignore_eos=True)
            assert received["x"].token_ids == fake_tokens([11, 12], 5)
        assert engine_cores(proc.pid) != [engine]


async def test_kill_9_of_one_api_server_drops_only_its_connections_then_of_the_engine_core_resumes_every_stream(
    tiny_model_dir,
):
    """kill -9 of one API server drops only its connections and it is
    restarted; then kill -9 of the engine core resumes every API server's
    streams (the restarted one's too) once both reattach. One server for
    both (each fault's checks as in a test of its own)."""
    options = ("--fake-options", '{"step_delay_s": 0.01}')
    with trio.fail_after(120), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = await in_thread(wait_for_url, proc, 60)
        await one_api_server_killed(proc, url)
        await engine_core_killed(proc, url)
        tree = [proc.pid, *tree_of(proc.pid)]
        proc.send_signal(signal.SIGTERM)  # not a kill on the way out: that would leave the private directories
        assert await in_thread(proc.wait, 20) == 0
        assert not any(running(pid) for pid in tree)


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


@pytest.mark.parametrize(
    "to", ["the supervising process", "every process", "every process, twice", "every process, SIGHUP"]
)
async def test_sigterm_drains_every_api_servers_streams_then_exits_0_leaving_nothing(tiny_model_dir, to):
    """SIGTERM to every process is what systemd's default KillMode and a kill of
    the process group do: the children leave the stop to their parents.
    A second signal ends the grace at once (a long one, here). SIGHUP to every
    process is a terminal closing on its foreground process group (found: the
    API servers, in the supervising process's group, died of it at once, every
    stream cut short)."""
    twice = to.endswith("twice")
    signum = signal.SIGHUP if to.endswith("SIGHUP") else signal.SIGTERM
    grace = 30.0 if twice else 1.0
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
            for pid in tree if to.startswith("every process") else [proc.pid]:
                os.kill(pid, signum)
            if twice:  # found: the API servers dropped every connection
                await trio.sleep(0.3)  # the second signal comes while they drain: a time apart, not a wait
                for pid in tree:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        assert ends == [("shutdown", 1001)] * len(sockets)
        assert await in_thread(proc.wait, grace + 15) == 0
        gone_after = await in_thread(wait_gone, tree, signalled, grace + 15)
        assert gone_after < (5 if twice else grace + 5), f"{gone_after:.2f}s"
        assert proc.stderr is not None
        assert "unexpectedly" not in proc.stderr.read()  # they exited as asked


def private_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("trioserve-")}


def engine_cores_with_workers(pid: int) -> list[psutil.Process]:
    """The engine-core processes under ``pid`` that have started a worker (their handshake is done)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.cmdline()[-1] == "engine-core" and p.children():
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize(
    ("signum", "when"),
    [(signal.SIGTERM, "loading"), (signal.SIGKILL, "loading"), (signal.SIGKILL, "engine cores just started")],
)
async def test_a_signal_while_the_engines_load_stops_everything_at_once_and_leaves_nothing(
    tiny_model_dir, signum, when
):
    """SIGTERM: stopped at once (nothing serves yet, so nothing to drain), exit 0;
    kill -9: every process goes by itself. Either way the supervising process's
    private directory goes too, even when the engine cores have not had their
    handshake yet (found: it was left)."""
    before = private_dirs()
    options = ("--fake-options", '{"load_delay_s": 60}')
    with trio.fail_after(60), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        started = engine_cores_with_workers if when == "loading" else engine_cores
        await wait_until(lambda: started(proc.pid), 30)
        assert private_dirs() - before  # the API servers' directory, made before any of them
        tree = [proc.pid, *tree_of(proc.pid)]
        signalled = time.monotonic()
        proc.send_signal(signum)
        assert await in_thread(proc.wait, 15) == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
        gone_after = await in_thread(wait_gone, tree, signalled, 15)
        assert gone_after < 5, f"{gone_after:.2f}s"
        await wait_until(lambda: not private_dirs() - before, 5)
        if signum == signal.SIGTERM:
            assert proc.stderr is not None and "SIGTERM: shutting down" in proc.stderr.read()


async def test_an_api_server_killed_before_it_first_serves_is_restarted_and_serve_starts(tiny_model_dir):
    """Whichever life of an API server first serves reports the start: the
    "serving on" line comes, and a signal is then a drain as usual."""
    with trio.fail_after(60), spawned(argv(str(tiny_model_dir("llama")))) as proc:

        def first_api_server() -> list[int]:
            return api_servers(proc.pid)[:1]

        await wait_until(first_api_server, 30)
        victim = first_api_server()[0]
        os.kill(victim, signal.SIGKILL)  # it has not written its ready byte yet: it is still starting
        url = await in_thread(wait_for_url, proc, 30)
        pids = api_servers(proc.pid)
        assert len(pids) == 2 and victim not in pids
        with ExitStack() as stack:
            await in_thread(open_on_both, stack, url, pids)
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 15) == 0


@pytest.mark.parametrize("when", ["at the first start", "as a replacement"])
async def test_an_api_server_stopped_before_it_first_serves_is_killed_replaced_and_serve_starts(tiny_model_dir, when):
    """Every start-up wait has a deadline: an API server SIGSTOPped as it
    starts (at the first start, or as the replacement of one killed) is
    killed as hung (no sign of life within ``startup_timeout_s``, or no
    heartbeat once its loop runs) and replaced, and ``serve`` says it is
    serving (it waited for ever on the stopped one)."""
    # Deadlines a loaded machine meets: a healthy API server (or the survivor holding the test's connection) can be
    # starved for seconds, and a replacement's imports alone take about a second on an idle one; with tighter
    # deadlines the replacement of the victim was itself killed as hung, and its pid was gone when the test used it.
    startup_s, heartbeat_timeout_s = 10, 5
    options = ("--startup-timeout", str(startup_s), "--heartbeat-interval", "0.2")
    options += ("--heartbeat-timeout", str(heartbeat_timeout_s))
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = None
        others: set[int] = set()
        if when == "as a replacement":
            url = await in_thread(wait_for_url, proc, 30)
            killed, *rest = api_servers(proc.pid)
            others = {killed, *rest}
            os.kill(killed, signal.SIGKILL)
        victim = (await wait_until(lambda: set(api_servers(proc.pid)) - others, 20, interval=0.005)).pop()
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        killed_at: list[float] = []

        async def watch_victim() -> None:
            await wait_until(lambda: not running(victim), 30, interval=0.02)
            killed_at.append(time.monotonic())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_victim)  # timed apart from the replacement's start
            if url is None:
                url = await in_thread(wait_for_url, proc, 30)
        # The later of the two deadlines (it may have beaten once before it was stopped), and a margin for load.
        assert killed_at[0] - stopped_at < max(startup_s, heartbeat_timeout_s) + 5
        await wait_until(lambda: len(api_servers(proc.pid)) == 2, 10)
        pids = api_servers(proc.pid)
        assert victim not in pids
        with ExitStack() as stack:
            await in_thread(open_on_both, stack, url, pids)
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 15) == 0
        assert proc.stderr is not None
        assert re.search("no sign of life within|sent nothing for", proc.stderr.read())


async def test_the_api_key_reaches_no_api_server_environment_and_a_key_outside_ascii_works(tiny_model_dir, tmp_path):
    """The key (here not ASCII) comes to each API server over a pipe: none
    has it in its environment (``/proc/PID/environ``), and both accept it."""
    key = "пароль-s3cret"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    with trio.fail_after(60), spawned(argv(str(tiny_model_dir("llama")), "--api-key-file", str(key_file))) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        pids = api_servers(proc.pid)
        assert len(pids) == 2
        for pid in tree_of(proc.pid):
            environ = open(f"/proc/{pid}/environ", "rb").read()  # noqa: SIM115
            assert key.encode() not in environ and key.encode().hex().encode() not in environ
            assert b"s3cret" not in environ and b"s3cret".hex().encode() not in environ
        for pid in pids:
            told = bytes.fromhex(psutil.Process(pid).environ()[API_SERVER_ENV])
            assert msgspec.msgpack.decode(told, type=ApiServerInit).server_config.api_key is None
        with ExitStack() as stack:
            for conn in await in_thread(http_on_both, stack, port_of(url), pids):
                for headers, status in (({}, 401), ({"Authorization": f"Bearer {key}".encode()}, 200)):
                    conn.request("GET", "/v1/models", headers=headers)
                    response = conn.getresponse()
                    response.read()
                    assert response.status == status
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 15) == 0


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


async def test_an_engine_out_of_restarts_is_failed_on_every_api_server_and_the_other_serves_on(tiny_model_dir):
    """Found: each API server showed it ``restarting`` for good (counting one
    restart more), waiting for a life its supervising process never starts."""
    options = ("--data-parallel-size", "2", "--max-restarts", "0")
    with trio.fail_after(90), spawned(argv(str(tiny_model_dir("llama")), *options)) as proc, ExitStack() as stack:
        url = await in_thread(wait_for_url, proc, 60)
        pids = api_servers(proc.pid)
        connections = await in_thread(http_on_both, stack, port_of(url), pids)
        os.kill(engine_cores(proc.pid)[0], signal.SIGKILL)
        healths = [
            {
                "status": "ready",
                "engines": [{"engine": i, "status": "failed" if i == dead else "ready"} for i in (0, 1)],
            }
            for dead in (0, 1)
        ]
        await wait_until(lambda: http_call(connections[0], "GET", "/health") in [(200, h) for h in healths], 10)
        dead = [(200, h) for h in healths].index(http_call(connections[0], "GET", "/health"))
        for conn in connections:
            await wait_until(lambda conn=conn: http_call(conn, "GET", "/health") == (200, healths[dead]), 10)
            conn.request("GET", "/metrics")
            metrics = conn.getresponse().read().decode()
            restarts = {
                sample.labels["engine"]: sample.value
                for family in text_string_to_metric_families(metrics)
                for sample in family.samples
                if sample.name == "trioserve_engine_restarts_total"
            }
            assert restarts[str(dead)] == 0.0
        sockets = await in_thread(open_on_both, stack, url, pids)
        for ws in sockets:
            received = await in_thread(stream_on, ws, {"x": [11, 12]}, max_tokens=5, ignore_eos=True)
            assert received["x"].token_ids == fake_tokens([11, 12], 5)
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0


# --- with an engine on another host -------------------------------------------

HEARTBEAT_TIMEOUT_S = 1.5


def head_argv(model: str, port: int, keys: str, *options: str) -> list[str]:
    """Two API servers, engine 0 here, engine 1 joining from a headless tree."""
    return argv(
        model,
        *("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-rpc-port", str(port)),
        *("--curve-keys", keys, "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        *("--fake-options", '{"step_delay_s": 0.01}'),
        *options,
    )


def new_keys(tmp_path: Path) -> str:
    write_keys(tmp_path / "keys")
    return str(tmp_path / "keys")


@asynccontextmanager
async def observer(pid: int) -> AsyncIterator[Engine]:
    """An API server of the test's own (index 9), attached beside those of the
    supervising process ``pid``: it sees every engine core's counters."""
    raw = psutil.Process(api_servers(pid)[0]).environ()[API_SERVER_ENV]
    init = msgspec.msgpack.decode(bytes.fromhex(raw), type=ApiServerInit)
    async with open_attached_engine(init.engine_config, 9, init.directory) as engine:
        yield engine


async def wait_live(engine: Engine, index: int, timeout: float = 20) -> None:
    supervisor = engine._group.supervisors[index]
    with trio.fail_after(timeout):
        while supervisor.live_client() is None:
            await supervisor.wait_changed()


async def num_requests(engine: Engine) -> list[int]:
    return [e.num_requests for e in (await engine.stats()).engines]


async def lands_on_both_engines(seen: Engine, ws: Any, tag: str, timeout: float = 10) -> None:
    """Streams on ``ws`` (4 at once, as the API server spreads them) until a
    batch has reached both engines; each one the runner's greedy tokens."""
    with trio.fail_after(timeout):
        for attempt in range(1000):
            before = await num_requests(seen)
            prompts = {f"{tag}{attempt}-{i}": [3 + i, 40 + attempt % 50, 7] for i in range(4)}
            received = await in_thread(stream_on, ws, prompts, max_tokens=8, ignore_eos=True)
            for request_id, prompt in prompts.items():
                assert received[request_id].token_ids == fake_tokens(prompt, 8)
            after = await num_requests(seen)
            if all(a > b for a, b in zip(after, before, strict=True)):
                return
            await trio.sleep(0.2)  # this API server has not attached to engine 1 yet


def long_streams(ws: Any, tag: str, started: Callable[[], None], killed: threading.Event) -> tuple[dict, set[str]]:
    """4 long streams on ``ws``; once each has its first delta, ``started()``;
    once ``killed`` is set, read for the heartbeat deadline and a margin.
    How the streams that ended did (code, seconds after the kill), and those
    still streaming at the end."""
    ids = [f"{tag}{i}" for i in range(4)]
    for i, request_id in enumerate(ids):
        ws.send(generate(request_id, [5, 6 + i], max_tokens=100_000, ignore_eos=True))
    first: set[str] = set()
    while first != set(ids):
        msg = json.loads(ws.recv(timeout=30))
        assert msg["type"] == "delta", msg
        first.add(msg["id"])
    started()
    assert killed.wait(30)
    killed_at = time.monotonic()
    ends: dict[str, tuple[str, float]] = {}
    streaming: set[str] = set()
    deadline = killed_at + HEARTBEAT_TIMEOUT_S + 1.5
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = json.loads(ws.recv(timeout=left))
        except TimeoutError:
            break
        if msg["type"] == "delta":
            assert msg["id"] not in ends, msg
            if time.monotonic() > deadline - 0.5:
                streaming.add(msg["id"])
        else:
            ends[msg["id"]] = (msg.get("code", msg["type"]), time.monotonic() - killed_at)
    return ends, streaming


def stop_tree(pid: int) -> list[int]:
    """SIGSTOP of ``pid`` and every descendant: a host gone silent, its connections left open."""
    pids = [pid, *tree_of(pid)]
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    return pids


async def fault_ends_its_streams(seen: Engine, url: str, pids: list[int], remote: int, fault: str) -> list[int]:
    """Long streams on both API servers, spread over both engines; then
    ``fault`` (kill -9 or SIGSTOP) of the headless tree ``remote``: on each
    API server, its streams there end as ``engine_dead`` within the heartbeat
    deadline, those on the head's engine go on. The pids of the tree."""
    with ExitStack() as stack:
        sockets = await in_thread(open_on_both, stack, url, pids)
        # The observer seeing the headless engine does not mean both API servers have attached to it yet.
        for n, ws in enumerate(sockets):
            await lands_on_both_engines(seen, ws, f"warm{n}-")
        before = await num_requests(seen)
        streaming, killed = trio.Semaphore(0), threading.Event()
        outcomes: list[tuple[dict, set[str]]] = []
        async with trio.open_nursery() as nursery:

            async def watch(ws: Any, tag: str) -> None:
                def started() -> None:
                    trio.from_thread.run_sync(streaming.release)

                outcomes.append(await in_thread(long_streams, ws, tag, started, killed))

            for n, ws in enumerate(sockets):
                nursery.start_soon(watch, ws, f"api{n}-")
            for _ in sockets:
                await streaming.acquire()
            stale = await num_requests(seen)
            assert stale[1] - before[1] >= 2  # each API server's streams are spread over both engines
            killed_tree = (kill_tree if fault == "kill -9" else stop_tree)(remote)
            killed.set()
    for ends, still in outcomes:
        assert ends, f"{fault}: no stream of this API server was on the headless engine"
        assert {code for code, _ in ends.values()} == {"engine_dead"}, (fault, ends)
        assert max(after for _, after in ends.values()) < HEARTBEAT_TIMEOUT_S + 1.0, (fault, ends)
        assert still and not still & set(ends)  # its streams on the head's engine go on
    return killed_tree


async def test_a_headless_tree_killed_or_silent_ends_its_streams_on_both_api_servers_and_both_use_it_again_once_back(
    tiny_model_dir, tmp_path
):
    """Two API servers stream the runner's greedy tokens on the head's engine
    and a headless one. kill -9 of the headless tree: its connections close,
    and the API servers know at once; SIGSTOP of the next tree (as a host
    that vanished): they know from its silence, within the heartbeat
    deadline. Each time the head's engine serves on, and once a new tree
    joins, both API servers use it again. (One head for every step: each
    fault is met by a tree that joined after the last one.)"""
    keys, port = new_keys(tmp_path), free_port()
    head = head_argv(str(tiny_model_dir("llama")), port, keys, "--no-resume-requests")  # its streams end
    with trio.fail_after(120), spawned(head) as proc:
        url = await in_thread(wait_for_url, proc, 45)
        pids = api_servers(proc.pid)
        async with observer(proc.pid) as seen:
            for fault in ("kill -9", "SIGSTOP"):
                with headless(headless_argv(port, keys)) as remote:
                    await wait_live(seen, 1)
                    killed_tree = await fault_ends_its_streams(seen, url, pids, remote.pid, fault)
                # (Stopped ones were killed on the way out, just now.)
                assert await in_thread(wait_gone, killed_tree, time.monotonic(), 5) < 5
                with ExitStack() as stack:  # the head's engine takes every new request meanwhile
                    for n, ws in enumerate(await in_thread(open_on_both, stack, url, pids)):
                        received = await in_thread(stream_on, ws, {f"x{n}": [11, 12]}, max_tokens=5, ignore_eos=True)
                        assert received[f"x{n}"].token_ids == fake_tokens([11, 12], 5)
            # A new headless tree joins: both API servers attach to it and use it again.
            with headless(headless_argv(port, keys)) as remote:
                await wait_live(seen, 1)
                with ExitStack() as stack:
                    for n, ws in enumerate(await in_thread(open_on_both, stack, url, pids)):
                        await lands_on_both_engines(seen, ws, f"again{n}-")
                tree = [remote.pid, *tree_of(remote.pid)]
                remote.send_signal(signal.SIGTERM)
                assert await in_thread(remote.wait, 20) == 0
        tree += [proc.pid, *tree_of(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0
        assert not any(running(pid) for pid in tree)


async def test_an_api_server_that_cannot_be_forked_is_started_again_after_its_backoff(fake_config, monkeypatch, caplog):
    """Found: a fork of an API server that failed (EAGAIN: the process table
    full) ended the whole ``serve`` (which then said "cannot listen"). It is
    a death like any other: counted, and the API server is started again."""
    from trioserve.server.api_servers.supervisor import ApiServers
    from trioserve.server.config import ServerConfig

    real_open_process = trio.lowlevel.open_process
    failures = [1]

    async def open_process(argv, **options):
        if failures[0] > 0 and argv[-1] == "trioserve.server.api_servers":
            failures[0] -= 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return await real_open_process(argv, **options)

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    servers = ApiServers(fake_config(restart_backoff_s=0.05), ServerConfig(port=0), 2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(servers.run)
            assert failures == [0] and sorted(servers.num_restarts) == [0, 1]
            with ExitStack() as stack:
                conns = await in_thread(http_on_both, stack, port, [c.pid for c in servers.children if c])
                assert [(await in_thread(http_call, conn, "GET", "/health"))[0] for conn in conns] == [200, 200]
            nursery.cancel_scope.cancel()
    assert any("could not start: [Errno 11] Resource temporarily unavailable" in r.message for r in caplog.records)
