"""ZeroMQ sockets driven natively from Trio: no thread per socket.

A zmq socket exposes one file descriptor (``zmq.FD``) that becomes readable
when the socket's *state* may have changed: a message arrived, room opened up
to send. It is edge-triggered, so a wake-up says nothing about how many
messages are waiting, and a message can be pending while the FD stays quiet.
The rules this module follows, everywhere:

- try the operation first with ``zmq.NOBLOCK``; only on ``zmq.Again`` wait;
- before every wait, read ``zmq.EVENTS`` (which also re-arms the FD) and
  retry instead of waiting if it already has the flag we want;
- one task uses a socket at a time (a second one gets
  ``trio.BusyResourceError``), because two tasks cannot wait on one FD.

Invariants: a message is sent whole or not at all (a cancelled multipart send
never leaves part of a message queued); ``close()`` wakes a waiting task with
``trio.ClosedResourceError`` before the socket goes away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import trio
import zmq

__all__ = ["TrioZmqSocket", "private_ipc_dir", "zmq_context"]

_context: zmq.Context[Any] | None = None
_context_pid = -1
_context_lock = threading.Lock()


def zmq_context() -> zmq.Context[Any]:
    """The process's one zmq context, created on first use (and again in a
    forked child, which must not use its parent's)."""
    global _context, _context_pid  # noqa: PLW0603 - one context per process, made on first use
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            _context = zmq.Context()
            _context_pid = os.getpid()
        return _context


class TrioZmqSocket:
    """Owns a zmq socket and drives it from Trio.

    Waits with ``trio.lowlevel.wait_readable`` on ``zmq.FD`` and, after any
    wake-up, keeps going while ``zmq.EVENTS`` says so; sends and receives use
    ``zmq.NOBLOCK`` and wait on ``zmq.Again``. One owner task at a time:
    concurrent use raises ``trio.BusyResourceError``.

    Sends wait (never drop) while the high-water mark is reached, for the
    socket types where zmq blocks (PUSH, DEALER, REQ, PAIR). ROUTER and PUB
    drop at the mark by zmq's own rules, unless ``router_mandatory`` is set.

    ``close()`` uses the socket's ``linger`` option: ``bind``/``connect``
    default it to 0 (pending messages are dropped at close); pass
    ``linger=ms`` to let zmq's I/O thread flush them in the background.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._kind = zmq.SocketType(_int_option(sock, zmq.TYPE)).name
        self._fd = _int_option(sock, zmq.FD)
        self._busy = False
        self._closed = False

    @classmethod
    def bind(cls, socket_type: int, address: str, **opts: Any) -> TrioZmqSocket:
        """A new socket of ``socket_type`` bound to ``address``, with options
        given by name (``identity=b"a"``, ``linger=0``, ``sndhwm=100``...)."""
        return cls(_new_socket(socket_type, opts, lambda s: s.bind(address)))

    @classmethod
    def connect(cls, socket_type: int, address: str, **opts: Any) -> TrioZmqSocket:
        """A new socket of ``socket_type`` connected to ``address``; options as
        for ``bind`` (they are set before connecting, as ``identity`` must be)."""
        return cls(_new_socket(socket_type, opts, lambda s: s.connect(address)))

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The underlying zmq socket, for options such as ``last_endpoint``.
        Do no I/O on it directly."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    # --- sending ------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        """Queue one single-frame message, waiting while the socket is full.

        If cancelled, the message was not queued.
        """
        await self.send_multipart((data,))

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Queue one message made of ``frames``, waiting while the socket is full.

        If cancelled, nothing was queued: the wait happens only before the
        first frame, and once the first frame is in, the rest follow at once.
        """
        if not frames:
            raise ValueError("a message needs at least one frame")
        with self._owner():
            await trio.lowlevel.checkpoint_if_cancelled()
            last = len(frames) - 1
            waited = await self._send_frame(frames[0], more=last > 0)
            if last > 0:
                # The first frame is queued: finish the message even if cancelled.
                with trio.CancelScope(shield=True):
                    for i, frame in enumerate(frames[1:], start=1):
                        waited |= await self._send_frame(frame, more=i < last)
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()

    async def _send_frame(self, frame: bytes, *, more: bool) -> bool:
        flags = zmq.NOBLOCK | (zmq.SNDMORE if more else 0)
        waited = False
        while True:
            try:
                self._sock.send(frame, flags, copy=False, track=False)
                return waited
            except zmq.Again:
                await self._wait_for(zmq.POLLOUT)
                waited = True

    # --- receiving ----------------------------------------------------------

    async def recv(self) -> bytes:
        """Receive one message and return its first (usually only) frame.

        If cancelled, no message was taken off the socket.
        """
        return (await self.recv_multipart())[0]

    async def recv_multipart(self) -> list[bytes]:
        """Receive one message, all its frames.

        If cancelled, no message was taken off the socket (zmq hands over a
        multipart message whole, so nothing is half-read).
        """
        with self._owner():
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
            while True:
                try:
                    frames: list[bytes] = self._sock.recv_multipart(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await self._wait_for(zmq.POLLIN)
                    waited = True
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return frames

    # --- waiting and ownership ----------------------------------------------

    async def _wait_for(self, flag: int) -> None:
        """Return once ``zmq.EVENTS`` has ``flag``; wait on the FD until then.

        Reading ``zmq.EVENTS`` is what re-arms the edge-triggered FD, so it
        is read before every wait, never after. If cancelled, nothing changed.
        """
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the zmq socket was closed")
            if _int_option(self._sock, zmq.EVENTS) & flag:
                return
            await trio.lowlevel.wait_readable(self._fd)

    @contextlib.contextmanager
    def _owner(self) -> Iterator[None]:
        if self._closed:
            raise trio.ClosedResourceError("the zmq socket is closed")
        if self._busy:
            raise trio.BusyResourceError("another task is already using this zmq socket")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    # --- closing ------------------------------------------------------------

    def close(self) -> None:
        """Close the socket; a task waiting on it gets ``trio.ClosedResourceError``.

        Idempotent. Unsent messages are kept for the socket's ``linger`` time
        by zmq's I/O thread; this call never blocks.
        """
        if self._closed:
            return
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside trio.run: nobody can be waiting
        self._sock.close()

    def __enter__(self) -> TrioZmqSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"<TrioZmqSocket {self._kind} {state}>"


def _int_option(sock: zmq.Socket[Any], option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)  # FD, TYPE and EVENTS are integer options
    return value


def _new_socket(socket_type: int, opts: dict[str, Any], attach: Callable[[zmq.Socket[Any]], object]) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq_context().socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, opts.pop("linger", 0))
        for name, value in opts.items():
            option = getattr(zmq, name.upper(), None)
            if not isinstance(option, int):
                raise ValueError(f"{name}: not a zmq socket option")
            sock.setsockopt(option, value)
        attach(sock)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


IPC_PATH_MAX_LEN = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107  # a Unix socket's path, in bytes
SHORT_TMP = "/tmp"


@contextlib.contextmanager
def private_ipc_dir(prefix: str = "trioserve-", *, socket_names: Sequence[str] = ()) -> Iterator[Path]:
    """A fresh directory only this user can enter (mode 0700), for ``ipc://``
    socket files (``socket_names``: those the caller binds in it) and other
    private files; it is removed, with whatever is in it, on exit.

    It is made in the temporary directory (``TMPDIR``), or in ``/tmp`` when
    the longest of ``socket_names`` there would pass the ~107 bytes a Unix
    socket path may have (zmq would fail to bind); ``OSError`` naming
    ``TMPDIR`` if neither will do.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=_ipc_base(prefix, max(map(len, socket_names), default=0))))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ipc_base(prefix: str, longest_name: int) -> str:
    def fits(base: str) -> bool:  # mkdtemp adds a slash and 8 characters, the socket a slash and its name
        return not longest_name or len(os.fsencode(base)) + len(prefix) + 8 + longest_name + 2 <= IPC_PATH_MAX_LEN

    base = tempfile.gettempdir()
    if fits(base):
        return base
    if fits(SHORT_TMP) and os.path.isdir(SHORT_TMP) and os.access(SHORT_TMP, os.W_OK | os.X_OK):
        return SHORT_TMP
    raise OSError(
        f"the temporary directory {base!r} is too long for ipc:// socket paths (at most {IPC_PATH_MAX_LEN} bytes "
        f"with the socket's name) and {SHORT_TMP} will not do: set TMPDIR to a shorter directory"
    )
