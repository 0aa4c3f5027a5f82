"""A child process is a task.

``supervise_process`` starts a child under a nursery and stays with it until
it is reaped; ``run_child_main`` is the other half, the entry point of every
child program. Between them runs a *parent-watch pipe*: the child inherits
its read end, the parent keeps the write end and never writes. The end of
that pipe (EOF) means "stop": either the parent asked (``stop()`` closes the
write end) or the parent is gone (the kernel closed it).

Invariants:
- the supervising task never returns or raises before the child is reaped;
- a child nobody asked to stop that exits (with any code) raises
  ``ProcessExited`` into the supervising nursery;
- after a stop, a child gets ``grace_s`` to exit, then SIGTERM, then after
  another ``grace_s`` SIGKILL;
- a child whose parent dies sees EOF at once and cancels its ``trio.run``;
  if it is stuck in sync code, a fallback thread ends it with ``os._exit(1)``
  ``TRIOSERVE_HARD_EXIT_S`` seconds (default 1.5) after the EOF.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

__all__ = ["ChildProcess", "ProcessExited", "run_child_main", "supervise_process"]

PARENT_FD_ENV = "TRIOSERVE_PARENT_FD"
HARD_EXIT_ENV = "TRIOSERVE_HARD_EXIT_S"
DEFAULT_HARD_EXIT_S = 1.5

log = logging.getLogger("trioserve.process")


def describe_exit(exit_code: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` (negative codes are signals)."""
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        signame = signal.Signals(-exit_code).name
    except ValueError:
        signame = f"signal {-exit_code}"
    return f"was killed by {signame}"


class ProcessExited(Exception):
    """A child process exited although nobody asked it to stop."""

    def __init__(self, name: str, pid: int, exit_code: int) -> None:
        super().__init__(name, pid, exit_code)
        self.name = name
        self.pid = pid
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}) {describe_exit(self.exit_code)}"


class ChildProcess:
    """The handle ``supervise_process`` reports once the child is started."""

    def __init__(self, name: str, process: trio.Process, watch_fd: int) -> None:
        self.name = name
        self._process = process
        self._watch_fd: int | None = watch_fd
        self._wait_scope = trio.CancelScope()
        self.stop_requested_at: float | None = None  # trio.current_time() of the first stop()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """``None`` while it runs; negative: killed by that signal."""
        return self._process.returncode

    @property
    def stop_requested(self) -> bool:
        return self.stop_requested_at is not None

    def stop(self) -> None:
        """Ask the child to exit: close the parent-watch pipe (the child sees
        EOF and cancels its ``trio.run``). If it is still running ``grace_s``
        later it gets SIGTERM, and SIGKILL ``grace_s`` after that.
        Idempotent; call it from the Trio thread."""
        if self.stop_requested_at is None:
            self.stop_requested_at = trio.current_time()
            log.debug("%s (pid %d): asked to stop", self.name, self.pid)
        self._close_watch()
        self._wait_scope.cancel()

    def kill(self) -> None:
        """SIGKILL now (tests, last resort). Without ``stop()`` first, the
        supervisor treats the death as unexpected and raises ``ProcessExited``."""
        if self._process.returncode is None:
            self._process.kill()

    def _close_watch(self) -> None:
        if self._watch_fd is not None:
            fd, self._watch_fd = self._watch_fd, None
            os.close(fd)

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else describe_exit(self.returncode)
        return f"<ChildProcess {self.name} pid={self.pid} {state}>"


async def supervise_process(
    argv: list[str],
    *,
    name: str,
    pass_fds: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
    task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start ``argv`` as a child process and stay with it until it is reaped.

    Use as ``child = await nursery.start(supervise_process, argv, name=...)``.
    ``env`` (default: this process's environment) gets ``TRIOSERVE_PARENT_FD``
    added: the child's end of the parent-watch pipe, passed with ``pass_fds``.

    Returns once the child exits after ``child.stop()``. Raises
    ``ProcessExited`` if it exits without being asked, whatever the code.
    If cancelled, it stops the child (same escalation, shielded), reaps it,
    then lets the cancellation go on: nothing is left running.
    """
    read_fd, write_fd = os.pipe()  # both non-inheritable: only pass_fds hands read_fd on
    try:
        child_env = dict(os.environ if env is None else env)
        child_env[PARENT_FD_ENV] = str(read_fd)
        process = await trio.lowlevel.open_process(argv, pass_fds=(*pass_fds, read_fd), env=child_env)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    child = ChildProcess(name, process, write_fd)
    log.info("%s (pid %d) started: %s", name, child.pid, " ".join(argv))
    try:
        task_status.started(child)
        with child._wait_scope:
            await process.wait()
        if process.returncode is None:  # stop() was called
            await _stop_and_reap(child, grace_s)
    except BaseException:
        with trio.CancelScope(shield=True):
            child.stop()
            await _stop_and_reap(child, grace_s)
        raise
    finally:
        child._close_watch()
    _log_exit(child)
    if not child.stop_requested:
        raise ProcessExited(name, child.pid, child.returncode or 0)


async def _stop_and_reap(child: ChildProcess, grace_s: float) -> None:
    """Wait for a stopped child, escalating to SIGTERM then SIGKILL; deadlines
    count from the first ``stop()``. If cancelled, the child may still run:
    callers shield this (or call it again shielded)."""
    process = child._process
    stopped_at = child.stop_requested_at
    assert stopped_at is not None
    with trio.move_on_at(stopped_at + grace_s):
        await process.wait()
    if process.returncode is None:
        log.warning("%s (pid %d) did not exit %.1fs after stop: SIGTERM", child.name, child.pid, grace_s)
        process.terminate()
        with trio.move_on_at(stopped_at + 2 * grace_s):
            await process.wait()
    if process.returncode is None:
        log.warning("%s (pid %d) ignored SIGTERM for %.1fs: SIGKILL", child.name, child.pid, grace_s)
        process.kill()
        await process.wait()


def _log_exit(child: ChildProcess) -> None:
    code = child.returncode
    assert code is not None
    if child.stop_requested:
        log.info("%s (pid %d) %s after stop", child.name, child.pid, describe_exit(code))
    else:
        log.warning("%s (pid %d) %s unexpectedly", child.name, child.pid, describe_exit(code))


# --- the child's side -------------------------------------------------------


def run_child_main(async_main: Callable[[], Awaitable[None]], *, name: str) -> None:
    """Run ``async_main`` as a supervised child: call it from ``__main__``.

    Ignores SIGINT (the parent decides when to stop). Under one nursery it
    runs ``async_main`` beside a task that cancels everything when the
    parent-watch pipe ends (stop, or parent gone) and one that does the same
    on SIGTERM. A daemon thread ends the process with ``os._exit(1)`` if it
    is still alive ``TRIOSERVE_HARD_EXIT_S`` seconds after the pipe ended.
    Exits the process with ``os._exit`` (no interpreter teardown): 0 after
    ``async_main`` returns or a stop, 1 (with the traceback on stderr) after
    an exception.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_process_title(name)
    parent_fd = _take_parent_fd()
    if parent_fd is None:
        log.warning("%s: no %s in the environment: not watching a parent", name, PARENT_FD_ENV)
    else:
        hard_exit_s = float(os.environ.get(HARD_EXIT_ENV, DEFAULT_HARD_EXIT_S))
        threading.Thread(
            target=_exit_soon_after_parent, args=(parent_fd, hard_exit_s), name="parent-watch-fallback", daemon=True
        ).start()
    code = 0
    try:
        trio.run(_child_root, async_main, parent_fd)
    except BaseException:
        sys.stderr.write(f"{name} (pid {os.getpid()}) failed:\n")
        traceback.print_exc()
        code = 1
    # Skip the interpreter's teardown: with torch loaded it can take seconds,
    # and a child holds nothing that the kernel does not release.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _take_parent_fd() -> int | None:
    raw = os.environ.pop(PARENT_FD_ENV, None)  # not for our own children
    if raw is None:
        return None
    fd = int(raw)
    os.set_inheritable(fd, False)
    return fd


async def _child_root(async_main: Callable[[], Awaitable[None]], parent_fd: int | None) -> None:
    """``async_main`` beside the stop watchers; returns when it returns or a
    stop cancels it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(_cancel_on_sigterm, nursery.cancel_scope)
        if parent_fd is not None:
            nursery.start_soon(_cancel_when_parent_pipe_ends, parent_fd, nursery.cancel_scope)
        await async_main()
        nursery.cancel_scope.cancel()


async def _cancel_on_sigterm(scope: trio.CancelScope, *, task_status: trio.TaskStatus[None]) -> None:
    """Cancel ``scope`` at the first SIGTERM. Cancelling this removes the handler."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            log.info("SIGTERM: stopping")
            scope.cancel()
            return


async def _cancel_when_parent_pipe_ends(fd: int, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once the parent-watch pipe is readable, which, as the
    parent never writes, means EOF. Cancelling this leaves the fd open."""
    await trio.lowlevel.wait_readable(fd)
    log.info("the parent closed the watch pipe: stopping")
    scope.cancel()


def _exit_soon_after_parent(fd: int, hard_exit_s: float) -> None:
    """Thread body: block until the pipe ends, give the Trio side
    ``hard_exit_s`` to finish, then end the process however it is doing."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while not poller.poll():
        pass
    deadline = time.monotonic() + hard_exit_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
    os.write(2, f"pid {os.getpid()}: still alive {hard_exit_s}s after the parent-watch pipe ended: exiting\n".encode())
    os._exit(1)


def _set_process_title(name: str) -> None:
    try:
        import setproctitle  # optional
    except ImportError:
        return
    setproctitle.setproctitle(name)
