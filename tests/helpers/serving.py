"""``trioserve`` run as a command, the way an operator runs it: spawn it,
read its URL, see which processes it left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
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


def tree_of(pid: int) -> list[int]:
    """``pid``'s descendants, now."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
