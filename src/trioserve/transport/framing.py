"""Length-prefixed msgspec frames on a byte stream, and a bridge to channels.

This is the wire between the engine core and each worker: a private
``AF_UNIX`` socketpair, one end inherited by the worker. The engine core's
end is a Trio stream bridged to memory channels (``MessageBridge``); the
worker's end is a blocking socket that one thread owns (``BlockingFrames``).

A frame is a 4-byte big-endian length followed by that many payload bytes.
Invariants: a frame is written whole or not at all (the write is shielded
from cancellation once it starts); a reader never returns part of a frame,
and a cancelled read loses nothing (what arrived stays buffered for the next
read); no frame longer than ``max_frame_bytes`` is written or accepted.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import trio

__all__ = [
    "MAX_FRAME_BYTES",
    "BlockingFrames",
    "FrameError",
    "FrameReader",
    "MessageBridge",
    "socket_from_fd",
    "socketpair_for_child",
    "stream_from_fd",
    "write_frame",
]

log = logging.getLogger("trioserve.framing")

MAX_FRAME_BYTES = 64 * 1024 * 1024
_HEADER = 4
_RECEIVE_CHUNK = 64 * 1024
_MAX_RECEIVE_CHUNK = 4 * 1024 * 1024
_COALESCE_BELOW = 64 * 1024  # smaller payloads are written with their header in one call


class FrameError(Exception):
    """A malformed or oversized frame, EOF in the middle of a frame, or a
    payload that does not decode."""


def _frame_parts(payload: bytes, max_frame_bytes: int) -> list[bytes]:
    """What to write for one frame: header and payload in one piece when
    small, else apart. Raises ``FrameError`` for a payload over the limit."""
    size = len(payload)
    if size > max_frame_bytes:
        raise FrameError(f"frame of {size} bytes is over the limit of {max_frame_bytes}")
    header = size.to_bytes(_HEADER, "big")
    return [header + payload] if size < _COALESCE_BELOW else [header, payload]


def _announced_size(header: bytes | bytearray, max_frame_bytes: int) -> int:
    """The payload size a header announces. Raises ``FrameError`` if over the limit."""
    size = int.from_bytes(header[:_HEADER], "big")
    if size > max_frame_bytes:
        raise FrameError(f"frame header announces {size} bytes, over the limit of {max_frame_bytes}")
    return size


async def write_frame(stream: trio.abc.SendStream, payload: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
    """Write one frame: the payload's length, then the payload.

    Raises ``FrameError`` for a payload over ``max_frame_bytes`` (nothing is
    written). If cancelled before the write starts, nothing is written; once
    it has started it finishes whole, even if cancelled meanwhile (so it can
    wait on a peer that is slow to read), and the cancellation is delivered
    at the caller's next checkpoint. A peer that is gone raises
    ``trio.BrokenResourceError``.
    """
    parts = _frame_parts(payload, max_frame_bytes)
    await trio.lowlevel.checkpoint_if_cancelled()
    with trio.CancelScope(shield=True):
        for part in parts:
            await stream.send_all(part)


class FrameReader:
    """Reads whole frames from a byte stream; one task reads at a time."""

    def __init__(self, stream: trio.abc.ReceiveStream, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._max = max_frame_bytes
        self._buf = bytearray()

    async def read(self) -> bytes | None:
        """The next frame's payload, or ``None`` at a clean EOF between frames.

        Raises ``FrameError`` at EOF inside a frame, or when a header
        announces more than ``max_frame_bytes``. If cancelled, nothing is
        lost: bytes already received stay buffered for the next ``read``.
        """
        if self._frame_end() is not None:
            await trio.lowlevel.checkpoint()
        while (end := self._frame_end()) is None:
            chunk = await self._stream.receive_some(self._wanted())
            if not chunk:
                if self._buf:
                    raise FrameError(f"EOF in the middle of a frame ({len(self._buf)} bytes of it arrived)")
                return None
            self._buf += chunk
        payload = bytes(self._buf[_HEADER:end])
        del self._buf[:end]
        return payload

    def _frame_end(self) -> int | None:
        """Where the first buffered frame ends, if it has all arrived."""
        if len(self._buf) < _HEADER:
            return None
        end = _HEADER + _announced_size(self._buf, self._max)
        return end if len(self._buf) >= end else None

    def _wanted(self) -> int:
        if len(self._buf) < _HEADER:
            return _RECEIVE_CHUNK
        missing = _HEADER + int.from_bytes(self._buf[:_HEADER], "big") - len(self._buf)
        return max(_RECEIVE_CHUNK, min(missing, _MAX_RECEIVE_CHUNK))


def stream_from_fd(fd: int) -> trio.SocketStream:
    """A Trio stream over an inherited ``AF_UNIX``/``SOCK_STREAM`` socket fd.

    Takes ownership of ``fd`` (closing the stream closes it) and makes it
    non-inheritable, so that this process's own children do not get it.
    """
    return trio.SocketStream(trio.socket.from_stdlib_socket(socket_from_fd(fd)))


def socketpair_for_child() -> tuple[trio.SocketStream, socket.socket]:
    """A connected ``AF_UNIX`` stream pair: the parent's Trio end, and the
    child's plain socket whose ``fileno()`` goes into ``pass_fds`` (which
    makes it inheritable in the child only). Close the child's end in the
    parent once the child is started."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return trio.SocketStream(trio.socket.from_stdlib_socket(parent_end)), child_end


SendT = TypeVar("SendT", bound=msgspec.Struct)
ReceiveT = TypeVar("ReceiveT")


class MessageBridge(Generic[SendT, ReceiveT]):
    """Bridges a byte stream to a pair of memory channels of typed messages.

    Outgoing messages (``msgspec.Struct``s) are encoded as msgpack, one per
    frame; incoming frames are decoded with ``receive_type`` (for instance a
    tagged ``Union``). Both channels hold ``capacity`` messages: a full
    outbox makes senders wait for the stream, a full inbox stops reading it.

    Closing every clone of the outbox half-closes the stream (the peer's
    bridge sees EOF) once every message sent before is written, and then
    sets ``writer_done``; ``run`` still goes on reading until the peer does
    the same. If the peer stops reading, sends on the outbox raise
    ``trio.BrokenResourceError``.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        receive_type: Any,
        capacity: int = 16,
        name: str = "",
        drop: tuple[type, ...] = (),
        on_receive: Callable[[ReceiveT], None] | None = None,
    ) -> None:
        """``receive_type``: the type (often a tagged ``Union``) incoming
        frames decode to, that is ``ReceiveT``. Messages of the ``drop``
        types (heartbeats) only count as signs of life: they are not queued.
        ``on_receive`` is called with each message to be queued as it is
        read, before it is queued (and so before ``run`` ends at the EOF
        that follows it). ``last_received_at`` is the ``trio.current_time()``
        of the last frame (or of the start), whatever it held."""
        self._drop = drop
        self._on_receive = on_receive
        self.last_received_at = trio.current_time()
        self.num_received = 0  # frames read so far
        self._stream = stream
        self._reader = FrameReader(stream)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[ReceiveT] = msgspec.msgpack.Decoder(receive_type)
        self._capacity = capacity
        self.name = name or "bridge"
        self._failure: BaseException | None = None
        self.writer_done = trio.Event()  # set when the writing half stops, however it stops

    async def run(
        self,
        *,
        task_status: trio.TaskStatus[
            tuple[trio.MemorySendChannel[SendT], trio.MemoryReceiveChannel[ReceiveT]]
        ] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Move messages until the peer closes its end.

        Reports ``(outbox_send, inbox_receive)`` through ``task_status``.
        Returns at the peer's EOF, after closing the inbox (its receivers get
        ``trio.EndOfChannel``). Raises ``FrameError``, naming the bridge, for
        a malformed or undecodable frame. Whenever it ends, the stream is
        closed and both channels are closed at this end. If cancelled, both
        directions stop where they are; a frame being written is finished
        first, a partly read frame is dropped with the stream.
        """
        outbox_send, outbox_receive = trio.open_memory_channel[SendT](self._capacity)
        inbox_send, inbox_receive = trio.open_memory_channel[ReceiveT](self._capacity)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, outbox_receive, nursery.cancel_scope)
                task_status.started((outbox_send, inbox_receive))
                await self._read_loop(inbox_send)
                nursery.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(self._stream)
        if self._failure is not None:
            raise self._failure

    async def _read_loop(self, inbox: trio.MemorySendChannel[ReceiveT]) -> None:
        """Frames -> messages -> inbox, until EOF or a bad frame (kept in
        ``_failure``). Closes the inbox however it ends."""
        async with inbox:
            while True:
                try:
                    payload = await self._reader.read()
                except FrameError as exc:
                    self._failure = FrameError(f"{self.name}: {exc}")
                    return
                except trio.BrokenResourceError:
                    payload = None  # the peer went away with our data unread: same as EOF
                if payload is None:
                    log.debug("%s: the peer closed its end", self.name)
                    return
                self.last_received_at = trio.current_time()
                self.num_received += 1
                try:
                    message = self._decoder.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self._failure = FrameError(f"{self.name}: undecodable frame: {exc}")
                    return
                if not isinstance(message, self._drop):
                    if self._on_receive is not None:
                        self._on_receive(message)
                    await inbox.send(message)

    async def _write_loop(self, outbox: trio.MemoryReceiveChannel[SendT], scope: trio.CancelScope) -> None:
        """Outbox -> frames, until the outbox closes (then half-close the
        stream) or the peer stops reading. Closes the outbox however it ends;
        if cancelled mid-frame, that frame is still written whole."""
        async with outbox:
            try:
                async for message in outbox:
                    await write_frame(self._stream, self._encoder.encode(message))
                if isinstance(self._stream, trio.abc.HalfCloseableStream):
                    await self._stream.send_eof()
            except trio.BrokenResourceError:
                log.debug("%s: the peer stopped reading", self.name)
            except (TypeError, msgspec.EncodeError, FrameError) as exc:
                # Not the peer's fault: stop the bridge and raise it from run().
                self._failure = exc
                scope.cancel()
            finally:
                self.writer_done.set()


def socket_from_fd(fd: int) -> socket.socket:
    """A (blocking) socket over an inherited ``AF_UNIX``/``SOCK_STREAM`` fd,
    for ``BlockingFrames``. Takes ownership of ``fd`` and makes it
    non-inheritable, so that this process's own children do not get it."""
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ValueError(f"fd {fd}: expected an AF_UNIX SOCK_STREAM socket, got {sock.family!r} {sock.type!r}")
    sock.set_inheritable(False)
    return sock


class BlockingFrames:
    """The same frames over a blocking socket, for one thread that owns it
    (a worker's conversation with its engine core). ``read`` and ``write``
    block; a timeout set on the socket applies to each call."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._max = max_frame_bytes

    def read(self) -> bytes | None:
        """The next frame's payload, or ``None`` at a clean EOF between frames.
        Raises ``FrameError`` at EOF inside a frame or for an oversized header."""
        header = self._read_exactly(_HEADER, at_frame_start=True)
        if header is None:
            return None
        payload = self._read_exactly(_announced_size(header, self._max), at_frame_start=False)
        assert payload is not None
        return payload

    def write(self, payload: bytes) -> None:
        """Write one frame. Raises ``FrameError`` for a payload over the limit
        (nothing is written), ``OSError`` if the peer is gone."""
        for part in _frame_parts(payload, self._max):
            self._sock.sendall(part)

    def _read_exactly(self, n: int, *, at_frame_start: bool) -> bytes | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                received = self._sock.recv_into(view[got:], min(n - got, _MAX_RECEIVE_CHUNK))
            except ConnectionResetError:  # the peer went away with our data unread: same as EOF
                received = 0
            if received == 0:
                if at_frame_start and got == 0:
                    return None
                part = "header" if at_frame_start else "payload"
                raise FrameError(f"EOF in the middle of a frame ({got} of the {n} bytes of its {part} arrived)")
            got += received
        return bytes(buf)
