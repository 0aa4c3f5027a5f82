"""``trioserve`` run as a command, the way an operator runs it: spawn it
(``serve``, or ``serve --headless`` for an engine on another host), read
its URL, see which processes it left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent.parent


def serve_argv(*options: str) -> list[str]:
    return [sys.executable, "-m", "trioserve.cli", "serve", "--port", "0", *options]


@contextmanager
def spawned(
    argv: list[str], env: dict[str, str] | None = None, *, stdin: int | None = None, cwd: Path = REPO
) -> Iterator[subprocess.Popen[str]]:
    """Run ``argv`` (in ``cwd``); on the way out, kill whatever of its process tree is left."""
    proc = subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env or dict(os.environ),
    )
    try:
        yield proc
    finally:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        # kill -9 of the top alone, as an operator would: its children see it
        # go and stop, removing the private directories they share. Killing
        # every process at once would leave those directories behind.
        proc.kill()
        proc.communicate(timeout=10)
        _, leftovers = psutil.wait_procs(tree, timeout=5)
        for p in leftovers:
            p.kill()


def wait_for_url(proc: subprocess.Popen[str], timeout: float) -> str:
    """The ws:// URL from the "serving on" line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {proc.wait()}: {proc.stderr.read() if proc.stderr else ''}")
        if line.startswith("trioserve: serving on "):
            url = line.split()[3]
            assert url.startswith("ws://127.0.0.1:") and "health: http://127.0.0.1:" in line, line
            return url
    raise AssertionError("no 'serving on' line")


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], since: float, limit: float) -> float:
    """Seconds from ``since`` until none of ``pids`` runs (zombies count as gone)."""
    while time.monotonic() < since + limit:
        if not any(running(pid) for pid in pids):
            break
        time.sleep(0.02)
    return time.monotonic() - since


def left_running(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """Those of ``pids`` still running once none runs or ``timeout`` seconds
    have passed (a process that has just exited may still be being reaped)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def tree_of(pid: int) -> list[int]:
    """``pid``'s descendants, now."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def headless_argv(port: int, keys_dir: str | None, *options: str) -> list[str]:
    """``serve --headless`` of engine 1 of 2, joining the head at 127.0.0.1:``port``
    (CURVE keys from ``keys_dir``, or plain TCP when it is None)."""
    keys = ["--curve-keys", keys_dir] if keys_dir is not None else ["--insecure-tcp"]
    return [
        sys.executable, "-m", "trioserve.cli", "serve", "--headless",
        "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port), *keys, *options,
    ]  # fmt: skip


@contextmanager
def headless(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A headless process tree; on the way out, whatever of it is left is killed."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.communicate(timeout=10)


def kill_tree(pid: int) -> list[int]:
    """``kill -9`` of ``pid`` and every descendant, at once; their pids."""
    pids = [pid, *tree_of(pid)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids
