"""The child's side of process supervision, and what any process must clean
up before it ends.

``run_child_main`` is the entry point of every child program (see
``process.py`` for the parent's side and the timing of a stop). This module
also holds ``this_process``: the children this process started and has not
reaped yet, and the paths it must remove if its parent dies. It is per
process by nature (a process never forks without exec here).

Invariants:
- whichever way a process under ``run_child_main`` ends (its ``async_main``
  returns or fails, a stop, the hard-exit fallback, a SIGTERM that arrives
  while a stop is already under way), it first SIGKILLs every live child
  (the whole group of one that leads a group) and reaps them, waiting at
  most ``REAP_WAIT_S``; a child started once that has begun is killed at once;
- the parent-watch pipe ends with ``STOP_BYTE`` when the parent asked for a
  stop, without it when the parent is gone; paths registered with
  ``remove_if_parent_dies`` are removed only in the second case (or if the
  parent pid changed), by the Trio side at once or by the fallback thread;
- a process whose parent is gone and which leads its own process group ends
  by SIGKILLing that group, itself included: no descendant outlives it;
- a SIGTERM reaching a child whose parent lives, before the parent asked it
  to stop, does not stop it: it came to the whole process group or cgroup
  (``timeout``, systemd's default ``KillMode``: twice, maybe), so the parent
  got it too and drains, and the child must serve on until the parent stops
  it. (Sent to the child alone, it is logged and left: SIGKILL ends a child
  at once, and its supervisor restarts it.) A SIGTERM after the parent asked
  for a stop (the parent's own escalation), or with no parent watch, stops it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import NoReturn

import trio

from trioserve.errors import sole_leaf
from trioserve.stdio import say

__all__ = ["ChildExit", "ChildFailed", "remove_if_parent_dies", "run_child_main"]

PARENT_FD_ENV = "TRIOSERVE_PARENT_FD"  # the child's end of the parent-watch pipe
PARENT_PID_ENV = "TRIOSERVE_PARENT_PID"  # the supervising process, to tell "parent gone" by getppid()
HARD_EXIT_ENV = "TRIOSERVE_HARD_EXIT_S"
DEFAULT_HARD_EXIT_S = 1.5
REAP_WAIT_S = 0.5  # how long an ending process waits for the children it SIGKILLed to be reapable
STOP_BYTE = b"s"  # written by the parent just before it closes the pipe to ask for a stop

log = logging.getLogger("trioserve.process")


def signal_child(pid: int, sig: int, *, group: bool) -> None:
    """Send ``sig`` to ``pid``, or to the process group it leads. Only for a
    child not yet reaped: then neither its pid nor its group id can have been
    reused. A process that is gone already is no error."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _ParentWatch:
    """The read end of the parent-watch pipe (non-blocking), and who the parent was."""

    def __init__(self, fd: int, parent_pid: int) -> None:
        self.fd = fd
        self.parent_pid = parent_pid
        self._lock = threading.Lock()
        self._ended_without_stop: bool | None = None  # None: the pipe has not ended yet

    def ended(self) -> bool:
        """The pipe has ended (a stop asked for, or the parent gone): it is
        readable. Never blocks; reads nothing."""
        return bool(select.select([self.fd], [], [], 0)[0])

    def parent_gone(self) -> bool:
        """The pipe ended without ``STOP_BYTE``, or this process has another
        parent now. Never blocks; reads the pipe at most once."""
        with self._lock:
            if self._ended_without_stop is None:
                try:
                    self._ended_without_stop = os.read(self.fd, 1) != STOP_BYTE
                except BlockingIOError:
                    pass  # still open: the parent neither asked nor died
        return bool(self._ended_without_stop) or os.getppid() != self.parent_pid


class _ThisProcess:
    """What this process must clean up before it ends: its live children (pid ->
    leads its own group) and the paths to remove if its parent dies. Used by the
    Trio thread, the fallback thread and the thread a late SIGTERM starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: dict[int, bool] = {}
        self._ending = False
        self._end_claimed = False
        self._orphan_paths: list[Path] = []
        self.watch: _ParentWatch | None = None

    def add_child(self, pid: int, *, leads_group: bool) -> None:
        with self._lock:
            self._children[pid] = leads_group
            ending = self._ending
        if ending:  # started while this process ends: it must not outlive it
            signal_child(pid, signal.SIGKILL, group=leads_group)

    def reap_child(self, pid: int, poll: Callable[[], int | None]) -> int | None:
        """``poll()`` (which reaps a dead child) and forget the child, under the
        lock, so that ``kill_children`` never signals a pid just freed."""
        with self._lock:
            code = poll()
            if code is not None:
                self._children.pop(pid, None)
        return code

    def kill_children(self) -> list[int]:
        """SIGKILL every live child (and group) now and any started later; returns their pids."""
        with self._lock:
            self._ending = True
            for pid, group in self._children.items():
                signal_child(pid, signal.SIGKILL, group=group)
            return list(self._children)

    def claim_end(self) -> bool:
        """True for the first thread that ends this process, False for any other."""
        with self._lock:
            first, self._end_claimed = not self._end_claimed, True
        return first

    def add_orphan_path(self, path: Path) -> None:
        with self._lock:
            self._orphan_paths.append(path)

    def remove_orphan_paths_if_parent_gone(self) -> bool:
        """Remove the registered paths if the parent is gone; returns whether it is."""
        if self.watch is None or not self.watch.parent_gone():
            return False
        with self._lock:
            paths, self._orphan_paths = self._orphan_paths, []
        for path in paths:
            _remove(path)
        return True


this_process = _ThisProcess()


def remove_if_parent_dies(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` (a file, or a directory with its contents) when this
    process ends because its parent died, not when the parent asked it to
    stop. Takes effect only in a process run by ``run_child_main`` under a
    supervisor; without a parent watch, nothing is removed."""
    if this_process.watch is None:
        log.warning("remove_if_parent_dies(%s): no parent watch in this process: it will not be removed", path)
    this_process.add_orphan_path(Path(path))


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass  # best effort: this runs on the way out


def _end_process(code: int) -> NoReturn:
    """End this process with exit ``code``, leaving nothing behind (see the
    module invariants). A thread that comes second waits for the first to exit."""
    if not this_process.claim_end():
        threading.Event().wait()  # forever: the first one's exit code stands
    parent_gone = this_process.remove_orphan_paths_if_parent_gone()
    pids = this_process.kill_children()
    deadline = time.monotonic() + REAP_WAIT_S
    for pid in pids:
        while True:
            try:
                reaped, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # the Trio thread reaped it first
                break
            if reaped or time.monotonic() > deadline:
                break
            time.sleep(0.005)
    if parent_gone and os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)  # nobody is left to kill our group after us
    os._exit(code)


class ChildFailed(Exception):
    """Raised out of a child's main once it has told its parent why it
    fails: the process exits 1 with one line on stderr (its name, pid and
    this message), not a traceback."""


class ChildExit(Exception):
    """Raised out of a child's main to end the process with ``code``, an
    end its parent tells by that code (not a failure): ``message`` goes to
    the log at INFO, and no "failed" line is written."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def hard_exit_seconds(environ: Mapping[str, str]) -> float:
    """``TRIOSERVE_HARD_EXIT_S`` in ``environ`` (default 1.5 s). Raises
    ``ValueError`` naming it unless it is a finite number of seconds >= 0
    (``float`` takes ``inf`` and ``nan``, which no timer can wait)."""
    raw = environ.get(HARD_EXIT_ENV)
    if raw is None:
        return DEFAULT_HARD_EXIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{HARD_EXIT_ENV}: must be a number of seconds >= 0, got {raw!r}")
    return value


def run_child_main(async_main: Callable[[], Awaitable[None]], *, name: str) -> None:
    """Run ``async_main`` as a supervised child: call it from ``__main__``.

    Ignores SIGINT and SIGHUP (the parent decides when to stop). Under one nursery it
    runs ``async_main`` beside a task that cancels everything when the
    parent-watch pipe ends (stop, or parent gone: then it first removes the
    paths given to ``remove_if_parent_dies``) and one that does the same on
    SIGTERM. A SIGTERM that arrives when that task is not listening (a stop
    is under way) ends the process at once, children first. A daemon thread
    ends the process (children first, exit code 1) if it is still alive
    ``TRIOSERVE_HARD_EXIT_S`` seconds after the pipe ended. Exits with
    ``os._exit`` (no interpreter teardown): 0 after ``async_main`` returns or
    a stop, 1 after an exception: with its traceback on stderr, or one line
    for a ``ChildFailed`` (a failure the child has reported itself); a
    ``ChildExit``'s own code, with no line, for an end the parent expects.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal's, to the whole group: the parent's to handle
    signal.signal(signal.SIGTERM, _on_late_sigterm)  # trio's receiver restores this when it closes
    _set_process_title(name)
    watch = this_process.watch = _take_parent_watch()
    if watch is None:
        log.warning("%s: no %s in the environment: not watching a parent", name, PARENT_FD_ENV)
    else:
        hard_exit_s = hard_exit_seconds(os.environ)
        threading.Thread(
            target=_end_soon_after_parent, args=(watch, hard_exit_s), name="parent-watch-fallback", daemon=True
        ).start()
    code = 0
    try:
        trio.run(_child_root, async_main, watch)
    except BaseException as exc:
        code = 1
        if (asked := sole_leaf(exc, ChildExit)) is not None:
            log.info("%s (pid %d) exits with code %d: %s", name, os.getpid(), asked.code, asked)
            code = asked.code
        else:
            _report_failure(name, exc)
    # Skip the interpreter's teardown: with torch loaded it can take seconds,
    # and a child holds nothing that the kernel does not release.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # gone or closed; None: closed at start
            stream.flush()
    _end_process(code)


def _report_failure(name: str, exc: BaseException) -> None:
    """One line for a ``ChildFailed`` (a failure the child has reported
    itself), else a traceback, on standard error; dropped where it is gone
    (``stdio.say``), so that the process still ends its children first."""
    if (failed := sole_leaf(exc, ChildFailed)) is not None:
        say(f"{name} (pid {os.getpid()}) failed: {failed}")
    else:
        say(f"{name} (pid {os.getpid()}) failed:\n" + "".join(traceback.format_exception(exc)).rstrip("\n"))


def _take_parent_watch() -> _ParentWatch | None:
    raw_fd = os.environ.pop(PARENT_FD_ENV, None)  # not for our own children
    raw_pid = os.environ.pop(PARENT_PID_ENV, None)
    if raw_fd is None:
        return None
    fd = int(raw_fd)
    os.set_inheritable(fd, False)
    os.set_blocking(fd, False)
    return _ParentWatch(fd, int(raw_pid) if raw_pid is not None else os.getppid())


async def _child_root(async_main: Callable[[], Awaitable[None]], watch: _ParentWatch | None) -> None:
    """``async_main`` beside the stop watchers; returns when it returns or a
    stop cancels it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(_cancel_on_sigterm, nursery.cancel_scope, watch)
        if watch is not None:
            nursery.start_soon(_cancel_when_parent_pipe_ends, watch, nursery.cancel_scope)
        await async_main()
        nursery.cancel_scope.cancel()


async def _cancel_on_sigterm(
    scope: trio.CancelScope, watch: _ParentWatch | None, *, task_status: trio.TaskStatus[None]
) -> None:
    """Cancel ``scope`` at a SIGTERM, unless the parent lives and has not
    asked for a stop: then the stop is the parent's (see the module
    docstring). Cancelling this puts back the handler that was there before
    (``_on_late_sigterm``)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            if watch is not None and not watch.ended():
                log.warning(
                    "SIGTERM: serving on; the parent (pid %d) stops this process (SIGKILL ends it now)",
                    watch.parent_pid,
                )
                continue
            log.info("SIGTERM: stopping")
            scope.cancel()
            return


async def _cancel_when_parent_pipe_ends(watch: _ParentWatch, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once the parent-watch pipe is readable (the stop byte
    or EOF); if the parent is gone, remove the orphan paths first. Cancelling
    this leaves the fd open."""
    await trio.lowlevel.wait_readable(watch.fd)
    if this_process.remove_orphan_paths_if_parent_gone():
        log.warning("the parent is gone: stopping")
    else:
        log.info("the parent asked to stop")
    scope.cancel()


def _on_late_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while trio's receiver is closed: before it opened, or while a
    stop is under way, when it means the parent's grace is over. End now with
    code 128 + SIGTERM, children first, from a thread, so that this handler
    never waits for a lock that the code it interrupted holds."""
    threading.Thread(target=_end_process, args=(128 + signum,), name="late-sigterm", daemon=True).start()


def _end_soon_after_parent(watch: _ParentWatch, hard_exit_s: float) -> None:
    """Thread body: block until the pipe ends, give the Trio side
    ``hard_exit_s`` to finish, then end the process however it is doing."""
    poller = select.poll()
    poller.register(watch.fd, select.POLLIN | select.POLLHUP)
    while not poller.poll():
        pass
    deadline = time.monotonic() + hard_exit_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
    message = f"pid {os.getpid()}: still alive {hard_exit_s}s after the parent-watch pipe ended: exiting\n"
    try:
        os.write(2, message.encode())
    except OSError:
        pass  # stderr gone: exit all the same
    _end_process(1)


def _set_process_title(name: str) -> None:
    try:
        import setproctitle  # optional
    except ImportError:
        return
    setproctitle.setproctitle(name)
