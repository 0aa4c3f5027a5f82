"""Engines on several hosts (docs/deployment.md): CURVE keys, a head and a
headless process tree joining it over TCP, on 127.0.0.1. Real processes,
the fake runner."""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import trio
import zmq
from helpers.fakes import fake_tokens, wait_no_children
from helpers.serving import REPO, free_port, headless, headless_argv, kill_tree, running, tree_of

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.api import open_attached_engine
from trioserve.cli import EXIT_ENGINE_DEAD, EXIT_USAGE, main
from trioserve.errors import EngineDeadError
from trioserve.frontend.engines.attached import read_engine_addresses
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.group import EngineGroup
from trioserve.messages import AddRequest, Attach, EngineOutputs, Hello, TokenOutput
from trioserve.nurseries.headless.main import HeadlessConfig
from trioserve.transport.curve import load_keys, write_keys
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir

HEARTBEAT_TIMEOUT_S = 1.5
_encode = msgspec.msgpack.Encoder().encode


@pytest.fixture
def keys_dir(tmp_path: Path) -> str:
    directory = tmp_path / "keys"
    write_keys(directory)
    return str(directory)


@pytest.fixture
def head_config(fake_config, keys_dir):
    """A head of two engines, one of them here: engine 1 joins over TCP."""
    return functools.partial(
        fake_config,
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_rpc_port=free_port(),
        curve_keys_dir=keys_dir,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        restart_backoff_s=0.05,
        restart_wait_s=10.0,
        num_kv_blocks=256,
    )


def head_of_one_remote_engine(fake_config, keys_dir: str, **options) -> tuple[EngineConfig, list[str]]:
    """A head with no engine of its own (``options``: more of its config), and
    the command of the headless host whose engine 0 it takes."""
    port = free_port()
    config = fake_config(
        data_parallel_size=1,
        data_parallel_size_local=0,
        data_parallel_rpc_port=port,
        curve_keys_dir=keys_dir,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        **options,
    )
    argv = headless_argv(port, keys_dir)
    argv[argv.index("--data-parallel-size") + 1] = "1"
    argv[argv.index("--data-parallel-start-rank") + 1] = "0"
    return config, argv


@contextmanager
def headless_logging_to(argv: list[str], stderr: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A headless process tree, its stderr into the file ``stderr`` (read it
    while it runs with ``wait_for_lines``); on the way out, what is left of it is killed."""
    with stderr.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out, cwd=REPO)
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)


LOG_LINE = re.compile(r"\S+ \S+ (?P<level>[A-Z]+) \S+\[\d+\] (?P<rest>.*)")  # date time LEVEL role[pid] logger: ...


def said(text: str) -> list[str]:
    """The lines of ``text`` (a standard error) that say something went wrong: log lines of level WARNING and
    above, as ``LEVEL logger: message``, and the command's own lines; not INFO's account of what happens."""
    lines = []
    for line in text.splitlines():
        if (log := LOG_LINE.fullmatch(line)) is None:
            lines.append(line)
        elif log["level"] not in ("DEBUG", "INFO"):
            lines.append(f"{log['level']} {log['rest']}")
    return lines


async def wait_for_lines(stderr: Path, *texts: str, count: int = 1) -> list[str]:
    """Wait until ``stderr`` has ``count`` lines holding any of ``texts``; all its lines (``said``)."""
    while True:
        lines = said(stderr.read_text())
        if sum(any(text in line for text in texts) for line in lines) >= count:
            return lines
        await trio.sleep(0.05)


async def wait_joined(engine: trioserve.Engine, index: int = 1, timeout: float = 30) -> int:
    """Wait until remote engine ``index`` has joined; its engine core's pid."""
    supervisor = engine._group.supervisors[index]
    with trio.fail_after(timeout):
        while supervisor.live_client() is None:
            await supervisor.wait_changed()
    client = supervisor.live_client()
    assert client is not None and client.info is not None
    return client.info.engine_pid


PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


async def check_served_by(engine: trioserve.Engine, index: int, prompt: list[int]) -> None:
    out = await engine.generate(prompt, PARAMS, engine_index=index)
    assert out.token_ids == fake_tokens(prompt, 6)


async def intruders_get_nowhere(
    engine: trioserve.Engine,
    attempts: list[list[tuple[TrioZmqSocket, bytes]]],
    listeners: list[TrioZmqSocket],
) -> None:
    """Each intruder's messages sent (half a second each: a send to a peer
    that refused the handshake may never complete); engine 1 still serves
    four requests of the engine's own; nothing reaches a listener, and no
    request of the intruders' was taken."""
    for messages in attempts:
        with trio.move_on_after(0.5):
            for sock, message in messages:
                await sock.send(message)
    for i in range(4):
        await check_served_by(engine, 1, [9 + i, 8])
    for sock in listeners:
        with trio.move_on_after(0.3):
            raise AssertionError(f"an intruder got {await sock.recv()!r}")
    stats = await engine.stats()
    assert [e.num_requests for e in stats.engines] == [0, 4]  # the intruders' never got in


# --- keys --------------------------------------------------------------------


def test_keys_are_written_private_and_looser_permissions_are_refused(tmp_path, capsys):
    directory = tmp_path / "keys"
    assert main(["keys", str(directory)]) == 0
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for file in directory.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
    keys = load_keys(directory)
    assert keys.public.decode() in capsys.readouterr().out and keys.secret.decode() not in repr(keys)
    assert main(["keys", str(directory)]) == EXIT_USAGE  # never overwrites a pair
    os.chmod(directory, 0o755)
    with pytest.raises(ValueError, match="mode 0755"):
        load_keys(directory)
    os.chmod(directory, 0o700)
    os.chmod(directory / "trioserve.key_secret", 0o640)
    with pytest.raises(ValueError, match=r"secret key file .* mode 0640"):
        load_keys(directory)


def test_keys_go_only_into_a_new_or_private_directory_which_is_never_chmod_ed(tmp_path, capsys, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (tmp_path / "file").touch()
    monkeypatch.chdir(tmp_path)
    for directory, why in [
        ("", "give a directory"),  # `trioserve keys "$UNSET"`: not the current directory
        (str(shared), "has mode 1777"),
        (str(tmp_path / "file"), "is not a directory"),
        ("/proc/no/such", "cannot create /proc/no/such"),
    ]:
        assert main(["keys", directory]) == EXIT_USAGE
        assert why in capsys.readouterr().err
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and sorted(os.listdir(tmp_path)) == ["file", "shared"]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert main(["keys", str(private)]) == 0
    load_keys(private)


def test_tcp_without_keys_is_refused_unless_insecure_tcp_says_so(fake_config, tiny_model_dir, capsys):
    with pytest.raises(ValueError, match="curve_keys_dir"):
        fake_config(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=free_port())
    fake_config(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=1234, insecure_tcp=True)
    model = str(tiny_model_dir("llama"))
    head = ["serve", "--model", model, "--runner", "fake", "--data-parallel-size", "2"]
    assert main([*head, "--data-parallel-size-local", "1"]) == EXIT_USAGE
    assert "curve_keys_dir" in capsys.readouterr().err
    assert main(headless_argv(1234, None)[3:-1]) == EXIT_USAGE  # --headless, no --curve-keys nor --insecure-tcp
    assert "curve_keys_dir" in capsys.readouterr().err


# --- who gets in -------------------------------------------------------------


async def test_a_peer_without_the_key_or_with_another_key_never_reaches_an_engine(head_config, tmp_path, keys_dir):
    other = write_keys(tmp_path / "other")
    ours = load_keys(keys_dir)
    config = head_config()
    intruders = {
        "no key": {},
        "another key": {
            "curve_serverkey": ours.public,
            "curve_publickey": other.public,
            "curve_secretkey": other.secret,
        },
    }
    hello = _encode(Hello(engine_index=1, pid=1))
    add = _encode(AddRequest(request_id="evil", prompt_token_ids=[5, 6, 7], params=PARAMS))
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            hub = engine._group.remote
            assert hub is not None and hub.authenticator is not None
            # At the handshake port: posing as engine 1, and sending a request.
            sockets = [TrioZmqSocket.connect(zmq.DEALER, hub.address, **opts) for opts in intruders.values()]
            for sock in sockets:
                with trio.move_on_after(0.5):
                    await sock.send(hello)
                    await sock.send(add)
            with headless(headless_argv(config.data_parallel_rpc_port, keys_dir)):
                await wait_joined(engine)
                client = engine._group.supervisors[1].live_client()
                assert client is not None
                # At the joined engine's own sockets: stealing its requests, faking its outputs.
                input_address, output_address = _addresses(client)
                thieves = [TrioZmqSocket.connect(zmq.PULL, input_address, **opts) for opts in intruders.values()]
                fakers = [TrioZmqSocket.connect(zmq.PUSH, output_address, **opts) for opts in intruders.values()]
                fake = _encode(EngineOutputs(outputs=[TokenOutput("x", [1], finish_reason="stop")]))
                await intruders_get_nowhere(engine, [[(sock, add), (sock, fake)] for sock in fakers], thieves)
                assert hub.num_hellos == 1  # the real engine core's only
                # The headless process's MayJoin, then its engine core's handshake, input and output sockets.
                assert hub.authenticator.num_refused >= 2 and hub.authenticator.num_allowed == 4
                for sock in sockets + thieves + fakers:
                    sock.close()
    assert await wait_no_children() == []


async def test_a_peer_without_the_key_never_reaches_a_headless_engine_through_its_api_server_sockets(
    head_config, tmp_path, keys_dir
):
    """The head of several API servers (its engine group, here in the test) and
    one API server of its (attached, here too); engine 1 on a headless tree,
    on fixed ports: intruders at those ports get nothing in, and nothing out."""
    other = write_keys(tmp_path / "other")
    ours = load_keys(keys_dir)
    intruders = [
        {},
        {"curve_serverkey": ours.public, "curve_publickey": other.public, "curve_secretkey": other.secret},
    ]
    config = head_config()
    api_port = free_port()
    argv = headless_argv(config.data_parallel_rpc_port, keys_dir, "--headless-address", "127.0.0.1")
    with private_ipc_dir("trioserve-api-") as directory, trio.fail_after(60):
        group = EngineGroup(config, api_servers_dir=str(directory))
        async with trio.open_nursery() as head:
            await head.start(group.run)
            with headless([*argv, "--headless-port", str(api_port)]):
                async with open_attached_engine(config, 0, str(directory)) as engine:
                    await wait_joined(engine)
                    addresses = read_engine_addresses(str(directory), 1)
                    assert addresses is not None
                    expected = (f"tcp://127.0.0.1:{api_port}", f"tcp://127.0.0.1:{api_port + 1}")
                    assert (addresses.input_address, addresses.output_address) == expected
                    # Posing as API server 1: sending requests, attaching to take outputs and heartbeats.
                    pushers = [TrioZmqSocket.connect(zmq.PUSH, addresses.input_address, **o) for o in intruders]
                    dealers = [TrioZmqSocket.connect(zmq.DEALER, addresses.output_address, **o) for o in intruders]
                    add = _encode(AddRequest(request_id="evil", prompt_token_ids=[5, 6], params=PARAMS, frontend=1))
                    attach = _encode(Attach(frontend=1, engine=1))
                    attempts = [[(p, add), (d, attach)] for p, d in zip(pushers, dealers, strict=True)]
                    await intruders_get_nowhere(engine, attempts, dealers)
                    for sock in pushers + dealers:
                        sock.close()
            head.cancel_scope.cancel()
    assert await wait_no_children() == []


async def test_a_headless_engine_core_that_cannot_listen_for_the_api_servers_says_so_and_joins_once_it_can(
    head_config, keys_dir, caplog
):
    caplog.set_level(logging.WARNING, logger="trioserve.supervisor")
    config = head_config()
    argv = headless_argv(config.data_parallel_rpc_port, keys_dir, "--headless-port", str(free_port()))
    taken = socket.create_server(("127.0.0.1", int(argv[-1])))  # the engine core's first port
    with taken, private_ipc_dir("trioserve-api-") as directory, trio.fail_after(60):
        group = EngineGroup(config, api_servers_dir=str(directory))
        async with trio.open_nursery() as head:
            await head.start(group.run)
            with headless(argv):
                with trio.fail_after(20):
                    while not any("cannot listen for the API servers" in r.getMessage() for r in caplog.records):
                        await trio.sleep(0.05)
                assert group.supervisors[1].live_client() is None
                taken.close()
                async with open_attached_engine(config, 0, str(directory)) as engine:
                    await wait_joined(engine)
                    await check_served_by(engine, 1, [4, 2])
            head.cancel_scope.cancel()
    assert await wait_no_children() == []


def test_a_headless_address_must_be_one_the_head_can_reach_and_its_ports_must_fit():
    config = functools.partial(HeadlessConfig, start_rank=1, num_engines=2, address="10.0.0.1", rpc_port=1)
    with pytest.raises(ValueError, match="headless_address"):
        config(insecure_tcp=True, api_address="0.0.0.0")
    with pytest.raises(ValueError, match="headless_port"):
        config(insecure_tcp=True, api_port=65533)
    assert config(insecure_tcp=True, api_address="10.0.0.2", api_port=65532).api_port == 65532


def _addresses(client: EngineCoreClient) -> tuple[str, str]:
    """The TCP endpoints a remote engine's client bound, as its ``HandshakeInit`` gave them."""
    assert client.handshake_init is not None
    return client.handshake_init.input_address, client.handshake_init.output_address


# --- a head and a headless tree ---------------------------------------------


async def test_head_and_headless_serve_on_both_engines_and_a_killed_headless_tree_fails_fast_and_rejoins(
    head_config, keys_dir
):
    # Requests are not resumed here: the streams asked for engine 1, which would wait for its next life.
    config = head_config(step_delay_s=0.02, resume_requests=False)
    argv = headless_argv(config.data_parallel_rpc_port, keys_dir)
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)
    with trio.fail_after(90):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.health == "ready"  # the head's own engine: it serves before any remote one joins
            await check_served_by(engine, 0, [5, 6])
            with headless(argv) as proc:
                await wait_joined(engine)
                await check_served_by(engine, 0, [7, 8])
                await check_served_by(engine, 1, [7, 8])
                # A stream on each engine; then kill -9 of the whole headless tree.
                async with (
                    engine.stream([3, 4], long, engine_index=0) as local,
                    engine.stream([3, 4], long, engine_index=1) as remote,
                ):
                    await local.__anext__()
                    await remote.__anext__()
                    pids = kill_tree(proc.pid)
                    killed_at = trio.current_time()
                    with pytest.raises(EngineDeadError, match="sent nothing"):
                        async for _ in remote:
                            pass
                    assert trio.current_time() - killed_at < HEARTBEAT_TIMEOUT_S + 1.5
                    assert (await local.__anext__()).token_ids  # the head's engine goes on
                    # New requests go to the head's engine, at once.
                    with trio.fail_after(5):
                        for i in range(3):
                            out = await engine.generate([20 + i], PARAMS)
                            assert out.token_ids == fake_tokens([20 + i], 6)
                assert not any(running(pid) for pid in pids)
            # A new headless tree: it rejoins and serves.
            with headless(argv) as proc:
                await wait_joined(engine)
                await check_served_by(engine, 1, [11, 12])
                assert engine._group.supervisors[1].num_restarts == 1
                # Its host stops it (SIGTERM): the head hears so at once, not a heartbeat timeout later.
                async with engine.stream([3, 4], long, engine_index=1) as remote:
                    await remote.__anext__()
                    proc.send_signal(signal.SIGTERM)
                    signalled = trio.current_time()
                    with pytest.raises(EngineDeadError, match=r"engine-core-1 \(pid \d+\) was stopped on its host"):
                        async for _ in remote:
                            pass
                    assert trio.current_time() - signalled < 1.0
                assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    assert await wait_no_children() == []


async def test_a_headless_engine_core_killed_again_and_again_leaves_no_directory_on_its_host(
    head_config, keys_dir, tmp_path
):
    """Each life of a headless engine core has a private directory of the
    headless process's (its tensor-parallel workers' rendezvous), removed
    however the life ends: kill -9 included, where the engine core cannot."""
    config = head_config(tensor_parallel_size=2)
    host_tmp = tmp_path / "host"  # the headless host's temporary directory: only its entries there
    host_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(host_tmp)}
    with trio.fail_after(90):
        async with trioserve.open_engine(config=config) as engine:
            with headless(headless_argv(config.data_parallel_rpc_port, keys_dir), env) as proc:
                pid = await wait_joined(engine)
                for _ in range(3):
                    await check_served_by(engine, 1, [5, 6])
                    assert len(os.listdir(host_tmp)) == 1  # this life's
                    os.kill(pid, signal.SIGKILL)
                    while (new_pid := await wait_joined(engine)) == pid:
                        await trio.sleep(0.05)
                    pid = new_pid
                await check_served_by(engine, 1, [7, 8])
                assert len(os.listdir(host_tmp)) == 1
                proc.send_signal(signal.SIGTERM)
                assert await trio.to_thread.run_sync(proc.wait, 30) == 0
            assert os.listdir(host_tmp) == []
    assert await wait_no_children() == []


async def test_a_headless_engine_whose_head_is_gone_stops_its_workers_and_joins_the_next_head(
    head_config, keys_dir, tmp_path
):
    config = head_config()
    stderr = tmp_path / "headless.err"
    with headless_logging_to(headless_argv(config.data_parallel_rpc_port, keys_dir), stderr) as proc:
        with trio.fail_after(90):
            async with trioserve.open_engine(config=config) as engine:
                first = await wait_joined(engine)
                workers = tree_of(first)
                assert workers
                await check_served_by(engine, 1, [5])
            gone_at = time.monotonic()
            # The head stopped, and said so: the engine core goes at once (not a heartbeat timeout
            # later, as for a head that vanished), workers first.
            while any(running(p) for p in (first, *workers)):
                assert time.monotonic() - gone_at < HEARTBEAT_TIMEOUT_S
                await trio.sleep(0.05)
            assert proc.poll() is None  # the headless process stays, to join again
            # One line says why the engine core went; it did not fail (found: three lines, among them
            # "failed: the front-end said it is stopping" and "exited with code 1 unexpectedly").
            lines = await wait_for_lines(stderr, "the head stopped")
            assert [line for line in lines if f"pid {first}" in line or "the head stopped" in line] == [
                "WARNING trioserve.headless: engine-core-1: the head stopped: joining "
                f"tcp://127.0.0.1:{config.data_parallel_rpc_port} again in 1.0s"
            ], lines
            async with trioserve.open_engine(config=config) as engine:
                second = await wait_joined(engine)
                assert second != first
                await check_served_by(engine, 1, [6])


async def test_a_head_that_stops_while_a_headless_engine_core_loads_tells_it_and_it_goes_at_once(
    fake_config, keys_dir, tmp_path
):
    """Found: a head stopped while the engine core joining it loaded its model
    said nothing (only a live engine core hears ``Ping(leaving)`` on its input
    socket): the engine core loaded to the end, then waited a heartbeat
    timeout, and failed in three lines."""
    # The headless worker loads for a minute: the head stops long before.
    config, argv = head_of_one_remote_engine(fake_config, keys_dir, load_delay_s=60.0)
    stderr = tmp_path / "headless.err"
    with headless_logging_to(argv, stderr) as proc, trio.fail_after(60):

        async def head() -> None:
            async with trioserve.open_engine(config=config):
                raise AssertionError("ready, though the headless worker loads for a minute")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(head)
            while len(tree := tree_of(proc.pid)) < 2:  # an engine core, and its worker loading
                await trio.sleep(0.05)
            await trio.sleep(0.5)  # a while into the load: not a wait for an event, the stop acts alike at any point
            nursery.cancel_scope.cancel()  # the head stops
        stopped_at = time.monotonic()
        while any(running(p) for p in tree):
            assert time.monotonic() - stopped_at < HEARTBEAT_TIMEOUT_S, "not told: gone only by a timeout"
            await trio.sleep(0.05)
        lines = await wait_for_lines(stderr, "the head stopped")
        assert not [line for line in lines if "failed" in line or "unexpectedly" in line], lines
        assert proc.poll() is None  # it waits for the next head


async def test_without_reconnect_a_headless_process_exits_when_its_head_is_gone(head_config, keys_dir):
    config = head_config()
    argv = headless_argv(config.data_parallel_rpc_port, keys_dir, "--no-headless-reconnect")
    with headless(argv) as proc, trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            pid = await wait_joined(engine)
            tree = [proc.pid, *tree_of(proc.pid)]
            assert pid in tree
        code = await trio.to_thread.run_sync(functools.partial(proc.wait, timeout=HEARTBEAT_TIMEOUT_S + 10))
        assert code == EXIT_ENGINE_DEAD
        assert not any(running(p) for p in tree)


async def test_a_head_with_no_engine_of_its_own_serves_once_a_headless_one_joins(fake_config, keys_dir):
    config, argv = head_of_one_remote_engine(fake_config, keys_dir)
    with headless(argv), trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:  # ready once engine 0 joined
            assert engine.health == "ready"
            await check_served_by(engine, 0, [4, 5, 6])
            assert engine._group.supervisors[0].remote
    assert await wait_no_children() == []


# --- a headless host that cannot join ---------------------------------------

# Each attempt of a headless host to join, as its log says: the line of this
# version, or an engine core that failed (what a version that starts one for
# each attempt says).
ATTEMPT = ("no answer from the head", "exited with code")


async def test_a_headless_host_with_no_head_says_so_in_one_line_per_attempt(keys_dir, tmp_path):
    port = free_port()  # nothing listens there
    argv = headless_argv(port, keys_dir, "--startup-timeout", "0.5")
    stderr = tmp_path / "headless.err"
    with headless_logging_to(argv, stderr) as proc, trio.fail_after(30):
        lines = await wait_for_lines(stderr, *ATTEMPT, count=2)
        assert proc.poll() is None
    assert not any("Traceback" in line for line in lines)
    no_answer = f"engine-core-1: no answer from the head at tcp://127.0.0.1:{port} within 0.5s"
    attempts = [line for line in lines if any(text in line for text in ATTEMPT)]
    assert all(no_answer in line and "(nothing accepted the connection): retrying in" in line for line in attempts)
    assert not any("trioserve-engine-core" in line for line in lines)  # none started: no head to join


async def test_a_headless_host_whose_head_holds_other_keys_says_that_it_may(head_config, tmp_path):
    other = tmp_path / "other"
    write_keys(other)
    config = head_config(startup_timeout_s=2.0)
    argv = headless_argv(config.data_parallel_rpc_port, str(other), "--startup-timeout", "0.5")
    stderr = tmp_path / "headless.err"
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            with headless_logging_to(argv, stderr):
                lines = await wait_for_lines(stderr, *ATTEMPT)
            hub = engine._group.remote
            assert hub is not None and hub.num_hellos == 0
    assert not any("Traceback" in line for line in lines)
    attempt = next(line for line in lines if any(text in line for text in ATTEMPT))
    assert "it accepted the connection but not the CURVE handshake" in attempt
    assert f"it may hold other keys than {other}" in attempt


async def test_a_second_headless_host_with_a_taken_rank_is_refused_and_joins_only_once_that_rank_is_free(
    head_config, keys_dir, tmp_path, caplog
):
    """Two hosts given the same --data-parallel-start-rank: the second is
    refused while the first's engine core is live (it used to take its place,
    and each then displaced the other, for ever); it says which rank is taken,
    and joins once the first host is gone."""
    caplog.set_level(logging.WARNING, logger="trioserve.remote")
    config = head_config(step_delay_s=0.01)
    argv = headless_argv(config.data_parallel_rpc_port, keys_dir)
    stderr = tmp_path / "second.err"
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    with trio.fail_after(90):
        async with trioserve.open_engine(config=config) as engine:
            with headless(argv) as first:
                pid = await wait_joined(engine)
                async with engine.stream([3, 4], long, engine_index=1) as stream:
                    with headless_logging_to(argv, stderr) as second:
                        with trio.fail_after(20):
                            lines = await wait_for_lines(stderr, "refused it")
                        refusal = next(line for line in lines if "refused it" in line)
                        assert f"engine 1 is taken: its engine core (remote pid {pid}) is live on the head" in refusal
                        assert not any("Traceback" in line for line in lines)
                        assert any("engine-core-1, which is live" in r.getMessage() for r in caplog.records)
                        # An engine core that says Hello without asking first is refused too.
                        hub = engine._group.remote
                        assert hub is not None
                        keys = load_keys(keys_dir).client_options()
                        with TrioZmqSocket.connect(zmq.DEALER, hub.address, **keys) as rogue:
                            await rogue.send(_encode(Hello(engine_index=1, pid=4242)))
                            while not any("(remote pid 4242) joined, but" in r.getMessage() for r in caplog.records):
                                await trio.sleep(0.05)
                        tokens = [token async for out in stream for token in out.token_ids]
                        assert len(tokens) == 300  # the first host's engine core served it to the end
                        assert await wait_joined(engine) == pid and tree_of(second.pid) == []
                        # The first host is gone: once the head lets its engine core go, the second joins.
                        kill_tree(first.pid)
                        while (new_pid := await wait_joined(engine)) == pid:
                            await trio.sleep(0.05)
                        assert new_pid in tree_of(second.pid)
                        await check_served_by(engine, 1, [7, 8])
                        assert len([line for line in stderr.read_text().splitlines() if "refused it" in line]) == 1
    assert await wait_no_children() == []
