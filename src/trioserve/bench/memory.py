"""Peak resident memory (and CPU time) of the processes a benchmark involves.

On Linux the kernel keeps each process's high-water mark (``VmHWM`` in
``/proc/PID/status``): that is the exact peak, read just before the
processes stop. Elsewhere, and as a fallback, a sampler polls RSS with
psutil every ``interval_s`` and keeps the largest value seen.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import trio


def read_hwm(pid: int) -> int | None:
    """``VmHWM`` of ``pid`` in bytes, or None where there is none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakMemory:
    """Peak RSS per named process. ``run`` samples until cancelled;
    ``peaks()`` folds in the kernel's high-water marks."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self._sampled: dict[str, int] = {}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
            self._sampled[name] = max(rss, self._sampled.get(name, 0))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample until cancelled. If cancelled, the peaks so far stay."""
        task_status.started()
        while True:
            self.sample()
            await trio.sleep(self.interval_s)

    def peaks(self) -> dict[str, int]:
        """Bytes per process; call while the processes still run."""
        self.sample()
        out = {}
        for name, pid in self.pids.items():
            hwm = read_hwm(pid)
            peak = max(hwm or 0, self._sampled.get(name, 0))
            if peak:
                out[name] = peak
        return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each named process has used so far (every
    thread; those that still run)."""
    out = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[name] = times.user + times.system
    return out


def server_processes(port: int) -> dict[str, int]:
    """The local process listening on ``port`` and its descendants, by role
    (``server``, ``engine-core-N``, ``worker-N``); empty if none is found
    (a remote server, or no permission to see it)."""
    try:
        listeners = [
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ]
    except (psutil.Error, OSError):
        return {}
    if not listeners:
        return {}
    server = psutil.Process(listeners[0])
    return {"server": server.pid, **_children_by_role(server)}


def _children_by_role(process: psutil.Process) -> dict[str, int]:
    roles: dict[str, int] = {}
    counts = {"engine-core": 0, "worker": 0}
    try:
        children = process.children(recursive=True)
    except psutil.Error:
        return roles
    for child in children:
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for role, count in counts.items():
            if f"entry {role}" in cmdline:
                roles[f"{role}-{count}"] = child.pid
                counts[role] += 1
    return roles
