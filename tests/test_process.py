"""A child process is a task: supervise_process and run_child_main, with real processes.

The child programs are in helpers/child.py; each reports "<role> <pid>" on an
inherited pipe when it is ready, so the tests wait on that, not on sleeps.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import trio

from trioserve.nurseries.supervision.process import SECRET_ENV_NAMES, ChildProcess, ProcessExited, supervise_process
from trioserve.transport.framing import MessageBridge, socketpair_for_child

HELPER = Path(__file__).parent / "helpers" / "child.py"
REPORT_FD_ENV = "TRIOSERVE_TEST_REPORT_FD"
SOCKET_FD_ENV = "TRIOSERVE_TEST_SOCKET_FD"
GRACE = 0.3


class Reports:
    """The read end of the pipe the helper children report on."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self._buffer = b""
        self.pids: list[int] = []

    async def next(self) -> tuple[str, int]:
        while b"\n" not in self._buffer:
            await trio.lowlevel.wait_readable(self.read_fd)
            chunk = os.read(self.read_fd, 4096)
            assert chunk, "every child closed the report pipe"
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        role, pid = line.decode().split()
        self.pids.append(int(pid))
        return role, int(pid)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, REPORT_FD_ENV: str(self.write_fd), **extra}

    def close(self) -> None:  # after the test's trio.run: nothing waits on read_fd
        os.close(self.read_fd)
        os.close(self.write_fd)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Sync fixtures on purpose: pytest-trio runs an async fixture only when the
# test names it, so an async autouse fixture would silently never run.
@pytest.fixture
def reports() -> Iterator[Reports]:
    reports = Reports()
    yield reports
    reports.close()


@pytest.fixture(autouse=True)
def no_process_left_behind(reports: Reports) -> Iterator[None]:
    me = psutil.Process()
    # Earlier tests' garbage (sockets held in reference cycles) is closed now, not during this test
    # (found: 24 descriptors before, 21 after, in the middle of a whole run).
    gc.collect()
    before, fds_before = {p.pid for p in me.children(recursive=True)}, me.num_fds()
    yield
    gc.collect()
    after = {p.pid for p in me.children(recursive=True)}
    leftovers = sorted(pid for pid in (after - before) | set(reports.pids) if running(pid))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert me.num_fds() == fds_before, "file descriptors leaked"


def helper(*args: str) -> list[str]:
    return [sys.executable, str(HELPER), *args]


async def start_helper(
    nursery: trio.Nursery,
    reports: Reports,
    *args: str,
    grace_s: float = GRACE,
    new_process_group: bool = False,
    **env: str,
) -> ChildProcess:
    child: ChildProcess = await nursery.start(
        partial(
            supervise_process,
            helper(*args),
            name="test-child",
            pass_fds=[reports.write_fd],
            env=reports.env(**env),
            grace_s=grace_s,
            new_process_group=new_process_group,
        )
    )
    return child


async def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    with trio.fail_after(2):
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            await trio.sleep(0.01)


async def wait_until_gone(pids: list[int], timeout: float) -> None:
    with trio.fail_after(timeout):
        while any(running(pid) for pid in pids):
            await trio.sleep(0.02)


def exited(exit_code: int) -> pytest.RaisesGroup[ProcessExited]:
    return pytest.RaisesGroup(pytest.RaisesExc(ProcessExited, check=lambda e: e.exit_code == exit_code))


async def test_stopped_child_exits_0_and_is_reaped(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "sleep", grace_s=5)
            assert await reports.next() == ("sleep", child.pid)
            started = trio.current_time()
            child.stop()
        assert trio.current_time() - started < 2
    assert child.returncode == 0
    assert not psutil.pid_exists(child.pid)


@pytest.mark.parametrize("mode", ["stuck", "plain-ignore-term"])
async def test_child_ignoring_stop_and_sigterm_is_killed_after_two_graces(reports: Reports, mode: str) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, mode, TRIOSERVE_HARD_EXIT_S="30")
            await reports.next()
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == -signal.SIGKILL
    assert 2 * GRACE - 0.05 < elapsed < 2 * GRACE + 1


async def test_child_deaf_to_the_pipe_gets_sigterm_after_one_grace(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "plain-default-term")
            await reports.next()
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == -signal.SIGTERM
    assert GRACE - 0.05 < elapsed < GRACE + 1


@pytest.mark.parametrize("code", [3, 0])
async def test_unexpected_exit_raises_process_exited_with_its_code(code: int) -> None:
    argv = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    with trio.fail_after(10), exited(code) as caught:
        async with trio.open_nursery() as nursery:
            child = await nursery.start(partial(supervise_process, argv, name="engine-core-0"))
    assert str(caught.value.exceptions[0]) == f"engine-core-0 (pid {child.pid}) exited with code {code}"
    assert child.returncode == code


async def test_a_program_that_cannot_start_raises_from_start() -> None:
    with trio.fail_after(5), pytest.RaisesGroup(FileNotFoundError):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(supervise_process, ["/nonexistent/program"], name="missing"))


async def test_killed_child_raises_process_exited_naming_the_signal(reports: Reports) -> None:
    with trio.fail_after(10), exited(-9) as caught:
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "sleep")
            await reports.next()
            child.kill()
    assert str(caught.value.exceptions[0]) == f"test-child (pid {child.pid}) was killed by SIGKILL"
    assert not psutil.pid_exists(child.pid)


async def test_child_failing_with_an_exception_exits_1(reports: Reports) -> None:
    with trio.fail_after(10), exited(1):
        async with trio.open_nursery() as nursery:
            await start_helper(nursery, reports, "fail")


@pytest.mark.parametrize(("mode", "returncode"), [("sleep", 0), ("stuck", -signal.SIGKILL)])
async def test_cancelling_the_supervising_nursery_stops_and_reaps_the_child(
    reports: Reports, mode: str, returncode: int
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, mode, TRIOSERVE_HARD_EXIT_S="30")
            await reports.next()
            started = trio.current_time()
            nursery.cancel_scope.cancel()
        elapsed = trio.current_time() - started
    assert nursery.cancel_scope.cancelled_caught
    assert child.returncode == returncode
    assert elapsed < 2 * GRACE + 1
    assert not psutil.pid_exists(child.pid)


async def test_descendants_exit_when_their_parent_is_killed(reports: Reports) -> None:
    # test -> intermediate (chain1) -> child (chain0) -> grandchild (sleep)
    with trio.fail_after(10):
        with exited(-9):
            async with trio.open_nursery() as nursery:
                intermediate = await start_helper(nursery, reports, "chain", "1", "sleep")
                roles = dict([await reports.next() for _ in range(3)])
                assert roles["chain1"] == intermediate.pid
                intermediate.kill()
        started = trio.current_time()
        await wait_until_gone([roles["chain0"], roles["sleep"]], timeout=2)
        assert trio.current_time() - started < 2


async def test_child_stuck_in_sync_code_exits_by_the_fallback_after_its_parent_dies(reports: Reports) -> None:
    # test -> intermediate (chain0) -> stuck leaf, whose trio loop never runs again.
    with trio.fail_after(10):
        with exited(-9):
            async with trio.open_nursery() as nursery:
                intermediate = await start_helper(nursery, reports, "chain", "0", "stuck", TRIOSERVE_HARD_EXIT_S="0.5")
                roles = dict([await reports.next() for _ in range(2)])
                intermediate.kill()
        started = trio.current_time()
        await wait_until_gone([roles["stuck"]], timeout=2)
        assert trio.current_time() - started > 0.4  # it was the fallback, not the trio watcher


class Ping(msgspec.Struct, tag=True):
    n: int


async def test_pass_fds_hands_a_socket_to_the_child(reports: Reports) -> None:
    parent_end, child_end = socketpair_for_child()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            try:
                child = await nursery.start(
                    partial(
                        supervise_process,
                        helper("echo"),
                        name="echo",
                        pass_fds=[reports.write_fd, child_end.fileno()],
                        env=reports.env(**{SOCKET_FD_ENV: str(child_end.fileno())}),
                        grace_s=GRACE,
                    )
                )
            finally:
                child_end.close()
            outbox, inbox = await nursery.start(MessageBridge(parent_end, receive_type=Ping, name="to-echo").run)
            await reports.next()
            for n in range(3):
                await outbox.send(Ping(n))
            assert [await inbox.receive() for _ in range(3)] == [Ping(0), Ping(1), Ping(2)]
            await outbox.aclose()  # the child's inbox ends, it closes its outbox: our bridge sees EOF
            with pytest.raises(trio.EndOfChannel):
                await inbox.receive()
            child.stop()
    assert child.returncode == 0


async def test_run_child_main_exit_codes_without_a_supervisor(reports: Reports) -> None:
    run = partial(trio.run_process, check=False, capture_stderr=True, pass_fds=[reports.write_fd], env=reports.env())
    with trio.fail_after(10):
        done = await run(helper("return"))
        failed = await run(helper("fail"))
    assert done.returncode == 0
    assert failed.returncode == 1
    assert b"RuntimeError: boom" in failed.stderr


async def test_sigterm_makes_a_child_exit_0(reports: Reports) -> None:
    process: Any = None
    try:
        with trio.fail_after(10):
            process = await trio.lowlevel.open_process(helper("sleep"), pass_fds=[reports.write_fd], env=reports.env())
            await reports.next()
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process is not None and process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


async def test_a_supervised_child_serves_on_after_sigterms_until_its_parent_stops_it(reports: Reports) -> None:
    """A SIGTERM to the whole process group or cgroup (systemd, ``timeout``)
    reaches the child too, maybe twice; its parent (draining) is the one to
    stop it. Found: children stopped at once, cutting the parent's drain."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "sleep")
            await reports.next()
            for _ in range(2):
                os.kill(child.pid, signal.SIGTERM)
                await trio.sleep(0.5)  # time for the SIGTERM to act: it must not stop the child
                assert child.returncode is None and running(child.pid)
            child.stop()
    assert child.returncode == 0


# --- no orphan, ever ----------------------------------------------------------


async def test_a_stopped_child_kills_its_stopped_grandchild_before_its_parents_sigterm(reports: Reports) -> None:
    # test -> child (chain0, whose own grace for its leaf is 30 s) -> SIGSTOPped leaf
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(
                nursery, reports, "chain", "0", "sleep",
                grace_s=2, TRIOSERVE_HARD_EXIT_S="0.3", TRIOSERVE_TEST_CHAIN_GRACE="30",
            )  # fmt: skip
            roles = dict([await reports.next() for _ in range(2)])
            await sigstop(roles["sleep"])
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == 1  # its own fallback: not our SIGTERM (at 2 s), nor our SIGKILL (at 4 s)
    assert elapsed < 2
    assert not running(roles["sleep"])


async def test_sigterm_during_a_stop_makes_a_child_kill_its_stopped_grandchild_first(reports: Reports) -> None:
    # The child's fallback comes too late (30 s): our SIGTERM, one grace after the stop, ends it.
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(
                nursery, reports, "chain", "0", "sleep",
                grace_s=1.0, TRIOSERVE_HARD_EXIT_S="30", TRIOSERVE_TEST_CHAIN_GRACE="30",
            )  # fmt: skip
            roles = dict([await reports.next() for _ in range(2)])
            await sigstop(roles["sleep"])
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == 128 + signal.SIGTERM  # not our SIGKILL, one grace later
    assert 1.0 - 0.05 < elapsed < 2.0
    assert not running(roles["sleep"])


async def test_the_fallback_of_a_child_stuck_in_sync_code_kills_its_stopped_grandchild(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(
                nursery, reports, "chain-stuck", "0", "sleep", grace_s=2, TRIOSERVE_HARD_EXIT_S="0.3"
            )
            roles = dict([await reports.next() for _ in range(2)])
            await sigstop(roles["sleep"])
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == 1
    assert 0.3 - 0.05 < elapsed < 2
    assert not running(roles["sleep"])


async def start_group_with_a_stopped_grandchild(
    nursery: trio.Nursery, reports: Reports, grace_s: float = GRACE
) -> tuple[ChildProcess, int]:
    """test -> child (a group leader) -> SIGSTOPped grandchild, its pid returned. When the leader
    dies, the kernel sends SIGHUP then SIGCONT to the stopped members of its newly orphaned
    group: this grandchild ignores SIGHUP and is stuck in sync code (fallback after 30 s), so
    only our group kill ends it soon."""
    child = await start_helper(
        nursery, reports, "chain", "0", "stuck",
        grace_s=grace_s, new_process_group=True, TRIOSERVE_HARD_EXIT_S="30", TRIOSERVE_TEST_IGNORE_SIGHUP="1",
    )  # fmt: skip
    roles = dict([await reports.next() for _ in range(2)])
    assert os.getpgid(roles["stuck"]) == child.pid
    await sigstop(roles["stuck"])
    return child, roles["stuck"]


async def test_a_group_leader_killed_directly_takes_its_stopped_grandchild_along(reports: Reports) -> None:
    with trio.fail_after(10):
        with exited(-signal.SIGKILL):
            async with trio.open_nursery() as nursery:
                child, grandchild = await start_group_with_a_stopped_grandchild(nursery, reports)
                os.kill(child.pid, signal.SIGKILL)
        await wait_until_gone([grandchild], timeout=1)


async def test_escalation_kills_the_group_of_a_stopped_group_leader(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child, grandchild = await start_group_with_a_stopped_grandchild(nursery, reports)
            await sigstop(child.pid)
            started = trio.current_time()
            child.stop()
        elapsed = trio.current_time() - started
    assert child.returncode == -signal.SIGKILL
    assert 2 * GRACE - 0.05 < elapsed < 2 * GRACE + 1
    await wait_until_gone([grandchild], timeout=1)


# --- hung children --------------------------------------------------------------


async def test_a_child_declared_hung_is_killed_and_reaped_at_once(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "sleep", grace_s=5)
            await reports.next()
            await sigstop(child.pid)
            started = trio.current_time()
            child.declare_hung()
        elapsed = trio.current_time() - started
    assert elapsed < 0.5  # no grace: a stopped process cannot use one
    assert child.killed_as_hung
    assert child.returncode == -signal.SIGKILL
    assert not psutil.pid_exists(child.pid)


async def test_declaring_a_group_leader_hung_kills_its_group(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child, grandchild = await start_group_with_a_stopped_grandchild(nursery, reports, grace_s=5)
            await sigstop(child.pid)
            started = trio.current_time()
            child.declare_hung()
        elapsed = trio.current_time() - started
    assert child.killed_as_hung
    assert elapsed < 0.5
    await wait_until_gone([grandchild], timeout=1)


async def test_a_stopped_child_was_not_killed_as_hung(reports: Reports) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, "sleep")
            await reports.next()
            child.stop()
        child.declare_hung()  # once reaped: nothing to do
    assert not child.killed_as_hung
    assert child.returncode == 0


# --- cleanup when the parent is gone ----------------------------------------------


@pytest.mark.parametrize(("mode", "hard_exit_s"), [("cleanup", "30"), ("cleanup-stuck", "0.3")])
async def test_a_child_removes_its_paths_when_its_parent_is_killed(
    reports: Reports, tmp_path: Path, mode: str, hard_exit_s: str
) -> None:
    # test -> parent (chain0, killed) -> child that registered ipc/; stuck: its fallback removes it
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    (ipc / "socket").touch()
    with trio.fail_after(10):
        with exited(-signal.SIGKILL):
            async with trio.open_nursery() as nursery:
                parent = await start_helper(
                    nursery, reports, "chain", "0", mode, str(ipc), TRIOSERVE_HARD_EXIT_S=hard_exit_s
                )
                roles = dict([await reports.next() for _ in range(2)])
                parent.kill()
        with trio.fail_after(2):
            while ipc.exists():
                await trio.sleep(0.02)
        await wait_until_gone([roles["cleanup"]], timeout=2)


@pytest.mark.parametrize(("mode", "returncode"), [("cleanup", 0), ("cleanup-stuck", 1)])
async def test_a_child_asked_to_stop_keeps_its_paths(
    reports: Reports, tmp_path: Path, mode: str, returncode: int
) -> None:
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await start_helper(nursery, reports, mode, str(ipc), grace_s=2, TRIOSERVE_HARD_EXIT_S="0.3")
            await reports.next()
            child.stop()
    assert child.returncode == returncode  # stuck: its fallback ended it
    assert ipc.is_dir()


# --- secrets ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "seen"), [("TRIOSERVE_API_KEY", "unset"), ("TRIOSERVE_TEST_MARKER", "set")])
@pytest.mark.parametrize("explicit_env", [True, False])
async def test_secrets_never_reach_a_child_environment(
    reports: Reports, monkeypatch: pytest.MonkeyPatch, name: str, seen: str, explicit_env: bool
) -> None:
    assert "TRIOSERVE_API_KEY" in SECRET_ENV_NAMES
    monkeypatch.setenv(name, "secret")
    monkeypatch.setenv(REPORT_FD_ENV, str(reports.write_fd))
    argv = helper("env", name)
    env = dict(os.environ) if explicit_env else None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            child = await nursery.start(
                partial(supervise_process, argv, name="env", pass_fds=[reports.write_fd], env=env, grace_s=GRACE)
            )
            assert await reports.next() == (seen, child.pid)
            child.stop()
