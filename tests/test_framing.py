"""Length-prefixed frames on a byte stream, and the bridge to memory channels."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from trioserve.transport.framing import (
    BlockingFrames,
    FrameError,
    FrameReader,
    MessageBridge,
    socket_from_fd,
    socketpair_for_child,
    stream_from_fd,
    write_frame,
)


class Ping(msgspec.Struct, tag=True):
    n: int


class Pong(msgspec.Struct, tag=True):
    n: int
    text: str = ""


Message = Ping | Pong


def stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Both ends of a socketpair, the second one built as a child builds it."""
    parent_end, child_end = socketpair_for_child()
    return parent_end, stream_from_fd(child_end.detach())


# --- frames -----------------------------------------------------------------


async def test_frames_round_trip_and_clean_eof_reads_none() -> None:
    payloads = [b"", b"x", bytes(range(256)) * 400, b"y" * (3 * 1024 * 1024)]
    left, right = stream_pair()
    reader = FrameReader(right)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def write_all() -> None:
                for payload in payloads:
                    await write_frame(left, payload)
                await left.aclose()

            nursery.start_soon(write_all)
            received = [await reader.read() for _ in payloads]
            assert await reader.read() is None
    assert received == payloads
    await right.aclose()


@pytest.mark.parametrize("partial", [b"\x00\x00", b"\x00\x00\x00\x0aabc"], ids=["in-header", "in-payload"])
async def test_eof_inside_a_frame_raises_frame_error(partial: bytes) -> None:
    left, right = stream_pair()
    with trio.fail_after(5):
        await left.send_all(partial)
        await left.aclose()
        with pytest.raises(FrameError, match="EOF in the middle of a frame"):
            await FrameReader(right).read()
    await right.aclose()


async def test_oversized_header_is_rejected_before_its_payload_arrives() -> None:
    left, right = stream_pair()
    with trio.fail_after(5):
        await left.send_all((17).to_bytes(4, "big"))
        with pytest.raises(FrameError, match="17 bytes, over the limit of 16"):
            await FrameReader(right, max_frame_bytes=16).read()
    await left.aclose()
    await right.aclose()


async def test_write_frame_refuses_an_oversized_payload_and_writes_nothing() -> None:
    left, right = stream_pair()
    reader = FrameReader(right)
    with trio.fail_after(5):
        with pytest.raises(FrameError, match="over the limit"):
            await write_frame(left, b"x" * 17, max_frame_bytes=16)
        await write_frame(left, b"next")
        assert await reader.read() == b"next"
    await left.aclose()
    await right.aclose()


async def test_cancelled_write_frame_writes_the_whole_frame_or_nothing() -> None:
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the socket buffers hold
    left, right = stream_pair()
    reader = FrameReader(right)
    with trio.fail_after(10):
        with trio.CancelScope() as scope:
            scope.cancel()
            await write_frame(left, b"never")  # cancelled before it starts: nothing written
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            finished = trio.Event()

            async def write_big() -> None:
                with scope:
                    await write_frame(left, big)
                    finished.set()
                    await trio.sleep_forever()

            nursery.start_soon(write_big)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not finished.is_set()  # still writing, shielded
            assert await reader.read() == big
        assert finished.is_set()
        await write_frame(left, b"after")
        assert await reader.read() == b"after"
    await left.aclose()
    await right.aclose()


async def test_cancelled_read_keeps_what_already_arrived() -> None:
    left, right = stream_pair()
    reader = FrameReader(right)
    frame = (5).to_bytes(4, "big") + b"hello"
    with trio.fail_after(5):
        await left.send_all(frame[:6])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.read)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()  # the read had taken 6 bytes into its buffer
        await left.send_all(frame[6:])
        assert await reader.read() == b"hello"
    await left.aclose()
    await right.aclose()


# --- the bridge ---------------------------------------------------------------


async def test_bridges_carry_typed_messages_both_ways() -> None:
    left, right = stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            a_out, a_in = await nursery.start(MessageBridge(left, receive_type=Message, name="a").run)
            b_out, b_in = await nursery.start(MessageBridge(right, receive_type=Message, name="b").run)
            await a_out.send(Ping(1))
            await a_out.send(Pong(2, "two"))
            assert [await b_in.receive(), await b_in.receive()] == [Ping(1), Pong(2, "two")]
            await b_out.send(Pong(3))
            assert await a_in.receive() == Pong(3)
            # Closing both outboxes is a clean shutdown: each run() returns.
            await a_out.aclose()
            await b_out.aclose()
            with pytest.raises(trio.EndOfChannel):
                await a_in.receive()
            with pytest.raises(trio.EndOfChannel):
                await b_in.receive()


async def test_peer_eof_ends_the_inbox_and_run_returns() -> None:
    left, right = stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            outbox, inbox = await nursery.start(MessageBridge(left, receive_type=Message).run)
            await write_frame(right, msgspec.msgpack.encode(Ping(7)))
            await right.aclose()
            assert await inbox.receive() == Ping(7)
            with pytest.raises(trio.EndOfChannel):
                await inbox.receive()
        # run() has returned: the outbox is dead.
        with pytest.raises(trio.BrokenResourceError):
            await outbox.send(Ping(8))


@pytest.mark.parametrize(
    ("payload", "match"),
    [(b"\xc1", "worker-0: undecodable frame"), (msgspec.msgpack.encode({"type": "Nope"}), "worker-0: undecodable")],
    ids=["not-msgpack", "wrong-type"],
)
async def test_malformed_frame_raises_frame_error_naming_the_bridge(payload: bytes, match: str) -> None:
    left, right = stream_pair()
    inbox: Any = None
    with trio.fail_after(5), pytest.RaisesGroup(pytest.RaisesExc(FrameError, match=match)):
        async with trio.open_nursery() as nursery:
            _, inbox = await nursery.start(MessageBridge(left, receive_type=Message, name="worker-0").run)
            await write_frame(right, payload)
            await trio.sleep_forever()
    with pytest.raises(trio.EndOfChannel):
        inbox.receive_nowait()
    await right.aclose()


async def test_cancelling_the_bridge_closes_the_stream() -> None:
    left, right = stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(MessageBridge(left, receive_type=Message).run)
            nursery.cancel_scope.cancel()
        assert await right.receive_some() == b""  # the peer sees EOF
    await right.aclose()


async def test_a_message_that_cannot_be_encoded_stops_the_bridge() -> None:
    left, right = stream_pair()
    with trio.fail_after(5), pytest.RaisesGroup(TypeError):
        async with trio.open_nursery() as nursery:
            outbox, _ = await nursery.start(MessageBridge(left, receive_type=Message).run)
            await outbox.send(object())
            await trio.sleep_forever()
    await right.aclose()


def test_stream_from_fd_rejects_a_datagram_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b, pytest.raises(ValueError, match="SOCK_STREAM"):
        stream_from_fd(a.fileno())


# --- the worker's end: blocking frames in one thread -----------------------------


async def test_a_bridge_and_blocking_frames_talk_both_ways() -> None:
    """The engine core's bridge and a worker's blocking thread, as they run."""
    parent_end, child_end = socketpair_for_child()
    worker_sock = socket_from_fd(child_end.detach())
    frames = BlockingFrames(worker_sock)
    decode = msgspec.msgpack.Decoder(Message).decode
    big = "z" * (3 * 1024 * 1024)  # over the size written with its header in one call

    def echo_until_eof() -> int:
        count = 0
        while (payload := frames.read()) is not None:
            ping = decode(payload)
            frames.write(msgspec.msgpack.encode(Pong(ping.n + 1, big if ping.n == 2 else "")))
            count += 1
        return count

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            outbox, inbox = await nursery.start(MessageBridge(parent_end, receive_type=Message, name="a").run)
            echoed: list[int] = []

            async def echo_thread() -> None:
                with worker_sock:  # closing it is the bridge's EOF: run() returns
                    echoed.append(await trio.to_thread.run_sync(echo_until_eof))

            nursery.start_soon(echo_thread)
            for n in range(3):
                await outbox.send(Ping(n))
                reply = await inbox.receive()
                assert isinstance(reply, Pong) and reply.n == n + 1
                assert reply.text == (big if n == 2 else "")
            await outbox.aclose()  # EOF for the thread, which then returns
        assert echoed == [3]


@pytest.mark.parametrize(
    ("sent", "match"),
    [(b"\x00\x00", "2 of the 4 bytes of its header"), (b"\x00\x00\x00\x09abc", "3 of the 9 bytes of its payload")],
    ids=["cut-in-header", "cut-in-payload"],
)
def test_blocking_frames_eof_inside_a_frame_is_an_error(sent: bytes, match: str) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(b"\x00\x00\x00\x01x" + sent)
        a.shutdown(socket.SHUT_WR)
        frames = BlockingFrames(b)
        assert frames.read() == b"x"
        with pytest.raises(FrameError, match=match):
            frames.read()


def test_blocking_frames_refuse_oversized_frames_both_ways() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        frames = BlockingFrames(b, max_frame_bytes=8)
        with pytest.raises(FrameError, match="9 bytes is over the limit of 8"):
            frames.write(b"x" * 9)
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(1)  # nothing was written
        a.sendall((1000).to_bytes(4, "big"))
        with pytest.raises(FrameError, match="announces 1000 bytes, over the limit of 8"):
            frames.read()


def test_blocking_frames_read_none_at_a_clean_eof_or_when_the_peer_is_gone() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with b:
        b.sendall(b"unread by a")  # a closes with data unread: b's read may see a reset
        a.close()
        assert BlockingFrames(b).read() is None


def test_socket_from_fd_rejects_a_datagram_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b, pytest.raises(ValueError, match="SOCK_STREAM"):
        socket_from_fd(a.fileno())
