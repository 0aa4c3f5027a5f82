"""A child process is a task.

``supervise_process`` starts a child under a nursery and stays with it until
it is reaped; ``run_child_main`` (``child_main.py``) is the other half, the
entry point of every child program. Between them runs a *parent-watch pipe*:
the child inherits its read end, the parent keeps the write end. ``stop()``
writes one byte on it and closes it; EOF without that byte means the parent
is gone (the kernel closed its end).

Invariants:
- the supervising task never returns or raises before the child is reaped;
  until then the child is in this process's registry of live children, and
  whatever ends this process (under ``run_child_main``) first SIGKILLs them;
- a child nobody asked to stop that exits (with any code) raises
  ``ProcessExited``; ``stop()`` and ``declare_hung()`` both ask, and
  ``expect_exit()`` says that it was asked otherwise (a signal of the
  caller's own, for a graceful exit);
- after a stop, a child gets ``grace_s`` to exit, then SIGTERM, then after
  another ``grace_s`` SIGKILL, of its whole process group if it leads one;
  ``declare_hung()`` skips the graces: SIGKILL (group too) at once;
- a child started with ``new_process_group`` leads a group that its own
  children join; once the leader is dead, and before it is reaped, the group
  gets SIGKILL, so even a SIGSTOPped grandchild dies with it;
- no child gets a variable named in ``SECRET_ENV_NAMES``.

Timing of a stop. P stops its child C (P's ``grace_s`` = G); C's trio.run is
cancelled and stops C's children W with C's own grace. Whatever C's Trio side
is doing, C's fallback thread, H = ``TRIOSERVE_HARD_EXIT_S`` (1.5 s) after
the pipe ended, SIGKILLs every W, reaps them (at most ``REAP_WAIT_S``, 0.5 s)
and exits 1: C and its children are gone by H + REAP_WAIT_S, and a W gets at
most H of C's grace. With H + REAP_WAIT_S < G (defaults 2 s < 5 s; a warning
says when a child's H breaks it), C is done with its children before P's
SIGTERM at G, let alone its SIGKILL at 2G: the chains nest. Each W's own
fallback (same H, inherited) fires at about the same time as C's; either way
W is gone. If H is too long, P's SIGTERM at G finds C's trio receiver closed
(its stop is under way): C then SIGKILLs and reaps its children and exits
143, still before 2G. If C cannot run at all (SIGSTOPped, or stuck in C code
holding the GIL), P's SIGKILL at 2G reaches W only through C's group.

Process groups and pid reuse. A group's id is its leader's pid, and the
kernel hands out no pid that a process still uses as its pid or group id.
While the leader is unreaped (a zombie keeps its pid) the group id is ours,
so we SIGKILL the group only then: we wait for the death with a pidfd (or
``waitid(WNOWAIT)``), neither of which reaps, kill the group, then reap.
After the reap the id is held only by the members still alive; if none
were, an unrelated process may get that pid and lead a group with it, so we
never kill the group after the reap. Nothing here reads trio's
``Process.returncode`` (which reaps) before that; ``ChildProcess.returncode``
is our own record, set when we reap. A member that made its own group
(setsid, setpgid) escapes the group kill.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

import trio

from trioserve.nurseries.supervision.child_main import (
    PARENT_FD_ENV,
    PARENT_PID_ENV,
    REAP_WAIT_S,
    STOP_BYTE,
    hard_exit_seconds,
    remove_if_parent_dies,
    run_child_main,
    signal_child,
    this_process,
)

__all__ = [
    "SECRET_ENV_NAMES",
    "ChildProcess",
    "ProcessExited",
    "python_argv",
    "remove_if_parent_dies",
    "run_child_main",
    "supervise_process",
]

# Environment variables that never reach a child process, whatever ``env``
# supervise_process is given: secrets that only the front-end needs.
SECRET_ENV_NAMES: frozenset[str] = frozenset({"TRIOSERVE_API_KEY"})


def python_argv(module: str, *args: str) -> list[str]:
    """``python -P -m module args``: a child of ours runs this interpreter,
    and imports nothing from the directory it was started in (``-P``): a
    ``random.py`` or ``trio.py`` in the working directory of ``serve`` would
    otherwise be imported by every child, and a file planted there would run
    as code in the server."""
    return [sys.executable, "-P", "-m", module, *args]


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

    def __init__(self, name: str, process: trio.Process, watch_fd: int, *, leads_group: bool = False) -> None:
        self.name = name
        self.leads_group = leads_group  # started as the leader of a new process group
        self._process = process
        self._watch_fd: int | None = watch_fd
        self._wait_scope = trio.CancelScope()
        self._returncode: int | None = None  # set when the supervising task reaps it
        self._killed_as_hung = False
        self.exit_expected = False  # expect_exit(): asked to exit by other means than stop()
        self.stop_requested_at: float | None = None  # trio.current_time() of the first stop()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """``None`` until it is reaped; negative: killed by that signal."""
        return self._returncode

    @property
    def stop_requested(self) -> bool:
        return self.stop_requested_at is not None

    @property
    def killed_as_hung(self) -> bool:
        """``declare_hung()`` SIGKILLed it (its exit code is then -SIGKILL)."""
        return self._killed_as_hung

    def stop(self) -> None:
        """Ask the child to exit: write the stop byte on the parent-watch pipe
        and close it (the child cancels its ``trio.run``). If it is still
        running ``grace_s`` later it gets SIGTERM, and SIGKILL ``grace_s``
        after that. Idempotent; call it from the Trio thread."""
        if self.stop_requested_at is None:
            self.stop_requested_at = trio.current_time()
            log.debug("%s (pid %d): asked to stop", self.name, self.pid)
        self._close_watch(STOP_BYTE)
        self._wait_scope.cancel()

    def expect_exit(self) -> None:
        """The caller asked the child to exit by its own means (a signal for a
        graceful exit, say): from now on its exit raises nothing, and is
        logged as asked for. Unlike ``stop()``, it neither closes the
        parent-watch pipe nor starts the graces."""
        self.exit_expected = True

    def declare_hung(self) -> None:
        """The child is hung (e.g. SIGSTOPped) and cannot use a grace: SIGKILL
        it now, its whole group if it leads one. The supervising task reaps it
        at once and, as after ``stop()``, raises nothing; ``killed_as_hung``
        tells the two apart. No-op once it is reaped. Call it from the Trio thread."""
        if self._returncode is not None:
            return
        log.warning("%s (pid %d) declared hung: SIGKILL", self.name, self.pid)
        self._killed_as_hung = True
        self.stop()
        signal_child(self.pid, signal.SIGKILL, group=self.leads_group)

    def kill(self) -> None:
        """SIGKILL now (tests, last resort). Without ``stop()`` first, the
        supervisor treats the death as unexpected and raises ``ProcessExited``."""
        if self._returncode is None:
            signal_child(self.pid, signal.SIGKILL, group=False)

    def _close_watch(self, last_byte: bytes = b"") -> None:
        if self._watch_fd is None:
            return
        fd, self._watch_fd = self._watch_fd, None
        try:
            if last_byte:
                os.write(fd, last_byte)  # an empty pipe: never blocks
        except BrokenPipeError:
            pass  # the child is gone already
        finally:
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
    new_process_group: bool = False,
    usual_exit_codes: frozenset[int] = frozenset(),
    runs_to_end: bool = False,
    stdout: int | None = None,
    stderr: int | None = None,
    task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start ``argv`` as a child process and stay with it until it is reaped.

    Use as ``child = await nursery.start(supervise_process, argv, name=...)``.
    ``env`` (default: this process's environment), less ``SECRET_ENV_NAMES``,
    gets ``TRIOSERVE_PARENT_FD`` (the child's end of the parent-watch pipe,
    passed with ``pass_fds``) and ``TRIOSERVE_PARENT_PID``. With
    ``new_process_group`` the child leads a new process group (see the module
    docstring for when the group is killed). ``stdout`` and ``stderr``: file
    descriptors for the child's (default: this process's).

    Returns once the child exits after ``child.stop()``,
    ``child.declare_hung()`` or ``child.expect_exit()``. Raises ``ProcessExited`` if it exits without
    being asked, whatever the code. If cancelled, it stops the child (same
    escalation, shielded), reaps it, then lets the cancellation go on:
    nothing is left running. An unasked exit with one of
    ``usual_exit_codes`` (an end the caller expects some day) is logged at
    INFO, not as a warning; it still raises ``ProcessExited``. A child that
    ``runs_to_end`` (a one-shot program) ends by itself: whatever its exit,
    it is its answer, read from ``child.returncode`` (logged at INFO), not
    ``ProcessExited``.
    """
    child = await _start(argv, name, pass_fds, env, grace_s, new_process_group, (stdout, stderr))
    log.info("%s (pid %d) started: %s", name, child.pid, " ".join(argv))
    try:
        task_status.started(child)
        with child._wait_scope:
            await _wait_until_dead(child.pid)
        if child.stop_requested:
            await _stop_and_wait(child, grace_s)
    except BaseException:
        with trio.CancelScope(shield=True):
            child.stop()
            await _stop_and_wait(child, grace_s)
        raise
    finally:
        with trio.CancelScope(shield=True):
            await _reap(child)
    _log_exit(child, usual_exit_codes, runs_to_end)
    if not child.stop_requested and not child.exit_expected and not runs_to_end:
        raise ProcessExited(name, child.pid, child.returncode or 0)


async def _start(
    argv: list[str],
    name: str,
    pass_fds: Sequence[int],
    env: Mapping[str, str] | None,
    grace_s: float,
    new_process_group: bool,
    stdio: tuple[int | None, int | None] = (None, None),
) -> ChildProcess:
    """Open the parent-watch pipe, start the child, register it as live."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: only pass_fds hands read_fd on
    try:
        child_env = {k: v for k, v in (os.environ if env is None else env).items() if k not in SECRET_ENV_NAMES}
        child_env[PARENT_FD_ENV] = str(read_fd)
        child_env[PARENT_PID_ENV] = str(os.getpid())
        _check_nesting(name, child_env, grace_s)
        process = await trio.lowlevel.open_process(
            argv,
            pass_fds=(*pass_fds, read_fd),
            env=child_env,
            cwd=_child_cwd(),
            process_group=0 if new_process_group else None,
            stdout=stdio[0],
            stderr=stdio[1],
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    this_process.add_child(process.pid, leads_group=new_process_group)
    return ChildProcess(name, process, write_fd, leads_group=new_process_group)


def _child_cwd() -> str | None:
    """Where a child starts: where this process is (None), or ``/`` when
    this process's working directory has been removed (a deploy directory
    swapped under a running ``serve``): torch cannot load in a removed
    directory (oneMKL: "Cannot load libtorch_cpu.so"), so every restart of the
    engine would fail. Paths relative to a removed directory lead nowhere
    either way."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return "/"
    return None


def _check_nesting(name: str, child_env: Mapping[str, str], grace_s: float) -> None:
    hard_exit_s = hard_exit_seconds(child_env)
    if hard_exit_s + REAP_WAIT_S >= grace_s:
        log.warning(
            "%s: grace_s %.2fs is not above its hard exit (%.2fs) + %.2fs: after a stop, it may get SIGTERM "
            "while it still waits on its own children",
            name,
            grace_s,
            hard_exit_s,
            REAP_WAIT_S,
        )


async def _wait_until_dead(pid: int) -> None:
    """Return once the child ``pid`` has exited, leaving it unreaped (so its
    pid, and the group id if it leads a group, stay ours). If cancelled, the
    child may still run."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd_open (not Linux >= 5.3), or reaped already: poll waitid
        while True:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:  # noqa: ASYNC222 - WNOHANG
                    return
            except ChildProcessError:  # reaped already: by this process's ending, which we cannot outlive
                return
            await trio.sleep(0.01)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


async def _stop_and_wait(child: ChildProcess, grace_s: float) -> None:
    """Wait for a stopped child to die, escalating to SIGTERM then SIGKILL
    (of its group, if it leads one); deadlines count from the first
    ``stop()``. Does not reap. If cancelled, the child may still run: callers
    shield this (or call it again shielded)."""
    stopped_at = child.stop_requested_at
    assert stopped_at is not None
    with trio.move_on_at(stopped_at + grace_s):
        await _wait_until_dead(child.pid)
        return
    log.warning("%s (pid %d) did not exit %.1fs after stop: SIGTERM", child.name, child.pid, grace_s)
    signal_child(child.pid, signal.SIGTERM, group=False)
    with trio.move_on_at(stopped_at + 2 * grace_s):
        await _wait_until_dead(child.pid)
        return
    what = "its process group" if child.leads_group else "it"
    log.warning("%s (pid %d) ignored SIGTERM for %.1fs: SIGKILL %s", child.name, child.pid, grace_s, what)
    signal_child(child.pid, signal.SIGKILL, group=child.leads_group)
    await _wait_until_dead(child.pid)


async def _reap(child: ChildProcess) -> None:
    """Reap a dead child; first, while its pid (its group id) is still ours,
    SIGKILL the group it leads. Sets ``child.returncode``."""
    if child.leads_group:
        signal_child(child.pid, signal.SIGKILL, group=True)
    code = this_process.reap_child(child.pid, child._process.poll)
    if code is None:  # still alive: only if waiting for its death failed above
        signal_child(child.pid, signal.SIGKILL, group=child.leads_group)
        code = await child._process.wait()
        this_process.reap_child(child.pid, child._process.poll)
    child._returncode = code
    child._close_watch()


def _log_exit(child: ChildProcess, usual_exit_codes: frozenset[int], runs_to_end: bool) -> None:
    code = child.returncode
    assert code is not None
    if child.killed_as_hung:
        log.info("%s (pid %d) %s after it was declared hung", child.name, child.pid, describe_exit(code))
    elif child.stop_requested:
        log.info("%s (pid %d) %s after stop", child.name, child.pid, describe_exit(code))
    elif child.exit_expected:
        level = logging.INFO if code == 0 else logging.WARNING
        log.log(level, "%s (pid %d) %s after it was asked to exit", child.name, child.pid, describe_exit(code))
    elif runs_to_end or code in usual_exit_codes:  # its caller says what it means; or a way its parent knows
        log.info("%s (pid %d) %s", child.name, child.pid, describe_exit(code))
    else:
        log.warning("%s (pid %d) %s unexpectedly", child.name, child.pid, describe_exit(code))
