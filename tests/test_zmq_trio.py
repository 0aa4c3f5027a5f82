"""ZeroMQ sockets driven from Trio through zmq.FD and zmq.EVENTS."""

from __future__ import annotations

import itertools
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
import zmq

from trioserve.transport import zmq_trio
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir, zmq_context

_inproc_names = itertools.count()


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    with private_ipc_dir() as path:
        yield path


def inproc_address() -> str:
    return f"inproc://test-{next(_inproc_names)}"


async def test_many_queued_messages_all_arrive(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir}/queue"
    with trio.fail_after(5):
        with TrioZmqSocket.bind(zmq.PULL, address) as pull, TrioZmqSocket.connect(zmq.PUSH, address) as push:
            for i in range(500):
                await push.send(b"%d" % i)
            received = [await pull.recv() for _ in range(500)]
    assert received == [b"%d" % i for i in range(500)]


async def test_a_burst_from_another_thread_all_arrives(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir}/burst"
    count = 2000
    all_received = threading.Event()

    def burst() -> None:
        with zmq_context().socket(zmq.PUSH) as push:
            push.connect(address)
            for i in range(count):
                push.send(b"%d" % i)
            # Closing now could drop what is still in flight: libzmq loses
            # messages when a PUSH closes while the receiver is at its HWM.
            all_received.wait(10)
            push.close(linger=0)

    with trio.fail_after(10):
        with TrioZmqSocket.bind(zmq.PULL, address) as pull:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, burst)
                try:
                    received = [await pull.recv() for _ in range(count)]
                finally:
                    all_received.set()
    assert received == [b"%d" % i for i in range(count)]


async def test_router_dealer_round_trip(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir}/router"
    with trio.fail_after(5):
        with (
            TrioZmqSocket.bind(zmq.ROUTER, address) as router,
            TrioZmqSocket.connect(zmq.DEALER, address, identity=b"dealer-1") as dealer,
        ):
            await dealer.send(b"hello")
            assert await router.recv_multipart() == [b"dealer-1", b"hello"]
            await router.send_multipart([b"dealer-1", b"world", b"!"])
            assert await dealer.recv_multipart() == [b"world", b"!"]
            await router.send_multipart([b"dealer-1", b"again"])
            assert await dealer.recv() == b"again"


async def test_cancelled_recv_returns_at_once_and_leaves_the_socket_usable() -> None:
    address = inproc_address()
    with trio.fail_after(5):
        with TrioZmqSocket.bind(zmq.PULL, address) as pull, TrioZmqSocket.connect(zmq.PUSH, address) as push:
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                finished = trio.Event()

                async def receive() -> None:
                    with scope:
                        await pull.recv()
                    finished.set()

                nursery.start_soon(receive)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert finished.is_set()
            await push.send(b"after")
            assert await pull.recv() == b"after"


async def test_close_wakes_a_waiting_task_with_closed_resource_error() -> None:
    address = inproc_address()
    with trio.fail_after(5):
        pull = TrioZmqSocket.bind(zmq.PULL, address)
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await pull.recv()

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            pull.close()
        pull.close()  # idempotent
        assert pull.closed
        with pytest.raises(trio.ClosedResourceError):
            await pull.recv()


async def test_two_concurrent_recvs_raise_busy_resource_error() -> None:
    with trio.fail_after(5):
        with TrioZmqSocket.bind(zmq.PULL, inproc_address()) as pull:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull.recv)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.BusyResourceError):
                    await pull.recv()
                nursery.cancel_scope.cancel()


async def test_send_waits_at_the_high_water_mark_then_resumes_without_dropping() -> None:
    address = inproc_address()
    count = 100
    sent = 0

    async def send_all(push: TrioZmqSocket) -> None:
        nonlocal sent
        for i in range(count):
            await push.send(b"%d" % i)
            sent += 1

    with trio.fail_after(5):
        with (
            TrioZmqSocket.bind(zmq.PULL, address, rcvhwm=4) as pull,
            TrioZmqSocket.connect(zmq.PUSH, address, sndhwm=4) as push,
        ):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, push)
                await trio.testing.wait_all_tasks_blocked()
                blocked_at = sent
                assert 0 < blocked_at < count
                await trio.testing.wait_all_tasks_blocked()
                assert sent == blocked_at
                received = [await pull.recv() for _ in range(count)]
    assert sent == count
    assert received == [b"%d" % i for i in range(count)]


async def test_cancelled_multipart_send_queues_nothing() -> None:
    address = inproc_address()
    with trio.fail_after(5):
        with (
            TrioZmqSocket.bind(zmq.PULL, address, rcvhwm=2) as pull,
            TrioZmqSocket.connect(zmq.PUSH, address, sndhwm=2) as push,
        ):
            sent = 0
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def fill() -> None:
                        nonlocal sent
                        while True:
                            await push.send_multipart([b"head-%d" % sent, b"tail-%d" % sent])
                            sent += 1

                    nursery.start_soon(fill)
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()
            received = [await pull.recv_multipart() for _ in range(sent)]
            assert received == [[b"head-%d" % i, b"tail-%d" % i] for i in range(sent)]
            assert not pull.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN  # (inproc: nothing in flight)


def test_options_are_set_by_name_and_linger_defaults_to_0(ipc_dir: Path) -> None:
    with TrioZmqSocket.bind(zmq.ROUTER, f"ipc://{ipc_dir}/options", sndhwm=7) as sock:
        assert sock.socket.getsockopt(zmq.SNDHWM) == 7
        assert sock.socket.getsockopt(zmq.LINGER) == 0
    with pytest.raises(ValueError, match="no_such_option"):
        TrioZmqSocket.bind(zmq.ROUTER, f"ipc://{ipc_dir}/bad", no_such_option=1)


def test_one_context_per_process() -> None:
    assert zmq_context() is zmq_context()


def test_private_ipc_dir_is_0700_and_removed_on_exit() -> None:
    with private_ipc_dir() as path:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        (path / "socket").touch()
    assert not path.exists()


def test_a_temporary_directory_too_long_for_socket_paths_gives_a_private_dir_in_tmp(tmp_path, monkeypatch) -> None:
    """Found: with a long ``TMPDIR``, ``serve`` failed with a traceback from
    zmq (an ipc path over 107 bytes)."""
    long = tmp_path / ("x" * 100)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    name = "engine-12-out"
    with private_ipc_dir("trioserve-api-", socket_names=["in", name]) as path:
        assert path.parent == Path(zmq_trio.SHORT_TMP)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        sock = zmq_context().socket(zmq.PULL)
        try:
            sock.bind(f"ipc://{path}/{name}")
        finally:
            sock.close(linger=0)
    assert not path.exists()
    with private_ipc_dir() as path:  # no socket in it: any length will do
        assert path.parent == long
    # In a shorter one, a name that just fits stays in TMPDIR; one byte more does not.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fits = zmq_trio.IPC_PATH_MAX_LEN - len(f"{tmp_path}/trioserve-12345678/")
    assert fits > 10
    with private_ipc_dir(socket_names=["x" * fits]) as path:
        assert path.parent == tmp_path
        sock = zmq_context().socket(zmq.PULL)
        try:
            sock.bind(f"ipc://{path}/{'x' * fits}")
        finally:
            sock.close(linger=0)
    with private_ipc_dir(socket_names=["x" * (fits + 1)]) as path:
        assert path.parent == Path(zmq_trio.SHORT_TMP)
    monkeypatch.setattr(zmq_trio, "SHORT_TMP", str(tmp_path / "no-such-dir"))
    with pytest.raises(OSError, match=r"too long for ipc:// socket paths .* set TMPDIR to a shorter directory"):
        with private_ipc_dir(socket_names=["x" * (fits + 1)]):
            pass
    assert os.listdir(long) == []
