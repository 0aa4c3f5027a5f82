"""Accepting through fd exhaustion (``server/listener.py``): the back-off and
its log lines as plain state, the accept loop over a scripted listener with
the autojump clock, and ``trioserve serve`` in a subprocess under a low
``RLIMIT_NOFILE``."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
import trio
import trio.testing
from helpers.server import http_get, stream_one
from helpers.serving import REPO, wait_for_url
from helpers.waiting import in_thread

from trioserve.server.listener import BACKOFF_MAX_S, QUIET_S, AcceptBackoff, accept_loop

EMFILE = OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def test_accept_backoff_doubles_from_10_ms_to_1_s_and_reports_start_every_10_s_and_the_end():
    backoff = AcceptBackoff()
    now, delays, lines = 100.0, [], []
    for _ in range(30):
        delay, line = backoff.failed(now, EMFILE, num_open=5)
        delays.append(delay)
        lines.append(line)
        now += delay
    assert delays[:8] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0])
    assert set(delays[7:]) == {BACKOFF_MAX_S}
    reported = [line for line in lines if line is not None]
    assert len(reported) == 3  # the start, then at most one per 10 s (24 s of failures)
    assert reported[0].startswith("accept failed: EMFILE (Too many open files), with 5 client connections open")
    assert all(line.startswith("accept still failing: EMFILE") for line in reported[1:])
    assert backoff.succeeded(now - 1 + QUIET_S) is None  # too soon after the last failure
    line = backoff.succeeded(now - 1 + QUIET_S + 1)
    assert line == "accept works again: it failed 30 times over 23.3 s, the last 6 s ago"
    assert backoff.succeeded(now + 100) is None
    assert backoff.failed(now + 100, EMFILE, num_open=0)[0] == 0.01  # a new episode starts over


def test_accept_that_flaps_between_failing_and_working_stays_one_episode():
    backoff, now, lines = AcceptBackoff(), 0.0, []
    for _ in range(1000):  # 100 s of: fail, wait, accept one, fail again
        delay, line = backoff.failed(now, EMFILE, num_open=5)
        assert delay == 0.01  # each success resets the back-off
        now += delay
        lines += [line, backoff.succeeded(now)]
        now += 0.09
    reported = [line for line in lines if line is not None]
    assert len(reported) == 10  # the start, then one per 10 s
    assert backoff.succeeded(now + QUIET_S) is not None


class ScriptedListener(trio.abc.Listener[trio.abc.AsyncResource]):
    """Fails, returns streams or waits (a float: seconds) as scripted, then waits forever."""

    def __init__(self, script: list[OSError | trio.abc.AsyncResource | float]) -> None:
        self.script = script
        self.calls: list[float] = []
        self.closed = False

    async def accept(self) -> trio.abc.AsyncResource:
        self.calls.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        while self.script:
            item = self.script.pop(0)
            if isinstance(item, float):
                await trio.sleep(item)
            elif isinstance(item, OSError):
                raise item
            else:
                return item
        await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()


async def test_accept_loop_backs_off_on_emfile_with_few_log_lines_and_no_traceback(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger="trioserve.server")
    streams = [trio.testing.MemorySendStream() for _ in range(3)]
    failures: list[OSError | trio.abc.AsyncResource | float] = [EMFILE] * 30
    listener = ScriptedListener([streams[0], *failures, streams[1], QUIET_S, streams[2]])
    accepted: list[trio.abc.AsyncResource] = []
    with trio.move_on_after(100):
        await accept_loop(listener, accepted.append, lambda: 3)
    assert accepted == streams and listener.closed
    gaps = [b - a for a, b in itertools.pairwise(listener.calls[1:])]
    assert gaps[:8] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0])
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 4, messages  # start, 2 x still failing, works again (only after the quiet time)
    assert messages[0].startswith("accept failed: EMFILE") and messages[-1].startswith("accept works again")
    assert all(record.exc_info is None for record in caplog.records)


async def test_accept_loop_raises_other_accept_errors(autojump_clock):
    listener = ScriptedListener([OSError(errno.EBADF, "Bad file descriptor")])
    with trio.fail_after(5), pytest.raises(OSError) as info:
        await accept_loop(listener, lambda stream: None, lambda: 0)
    assert info.value.errno == errno.EBADF and listener.closed


# --- fd exhaustion, in a subprocess -----------------------------------------------------


FD_LIMIT = 64  # the fake-runner server uses about 22 descriptors of its own
LAUNCHER = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
    "sys.argv[0] = 'trioserve'; runpy.run_module('trioserve.cli', run_name='__main__', alter_sys=True)"
)


@contextmanager
def serving_under_fd_limit(argv: list[str], limit: int) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``trioserve`` with ``argv``, under ``RLIMIT_NOFILE`` = ``limit``;
    yields the process and its stderr lines so far. Kills its tree on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(limit=limit), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout, proc.stderr
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(map(_plain, iter(stderr.readline, ""))), daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=10)
        stdout.close()
        stderr.close()


_LOG_PREFIX = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (\S+) \S+\[\d+\] ")  # date time LEVEL role[pid]


def _plain(line: str) -> str:
    """A log line as ``LEVEL logger: message`` (its date, time and process left out)."""
    return _LOG_PREFIX.sub(r"\1 ", line, count=1)


def wait_for_line(lines: list[str], start: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(line.startswith(start) for line in lines):
        assert time.monotonic() < deadline, f"no line starting {start!r} in {len(lines)} lines, ending {lines[-12:]}"
        time.sleep(0.02)


def exhaust_fds_then_free_them(port: int, lines: list[str]) -> None:
    """Open more idle connections than the server has descriptors; once its
    accept fails, wait a while, then close them all."""
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(FD_LIMIT + 16)]
    try:
        wait_for_line(lines, f"{WARNING}accept failed: EMFILE", 10)
        time.sleep(3)  # trio.serve_listeners would log 30 tracebacks meanwhile
    finally:
        for sock in clients:
            sock.close()


WARNING = "WARNING trioserve.server: "


async def test_accept_survives_fd_exhaustion_with_few_log_lines_and_serves_once_fds_are_free(tiny_model_dir):
    argv = ["serve", "--port", "0", "--model", str(tiny_model_dir("llama")), "--runner", "fake"]
    with trio.fail_after(90), serving_under_fd_limit([*argv, "--handshake-timeout", "60"], FD_LIMIT) as (proc, lines):
        url = await in_thread(wait_for_url, proc, 30)
        await in_thread(exhaust_fds_then_free_them, int(url.rsplit(":", 1)[1]), lines)
        health_url = url.replace("ws://", "http://") + "/health"
        assert await in_thread(http_get, health_url) == (200, {"status": "ready"})
        assert await in_thread(stream_one, url) == "done"
        await trio.sleep(QUIET_S)  # accept works for the quiet period: the next accept ends the episode
        assert await in_thread(http_get, health_url) == (200, {"status": "ready"})
        await in_thread(wait_for_line, lines, f"{WARNING}accept works again: it failed", 5)
        proc.terminate()
        assert await in_thread(proc.wait, 30) == 0
    about_accept = [line for line in lines if line.startswith(f"{WARNING}accept")]
    assert 2 <= len(about_accept) <= 3, about_accept  # failed, perhaps one "still failing", works again
    assert sum("RLIMIT_NOFILE" in line for line in lines) == 1  # the warning at start-up
    assert not any("Traceback" in line for line in lines), "".join(lines)
