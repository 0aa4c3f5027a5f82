"""Accepting TCP connections, even while the process is out of file descriptors.

``accept_loop`` takes the place of ``trio.serve_listeners``: one loop per
listener, handing each new connection to a callback that starts its task.
When ``accept`` fails for lack of resources (``EMFILE``, ``ENFILE``,
``ENOBUFS``, ``ENOMEM``: the load, not a bug), it backs off, doubling from
``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S``, and logs one warning line (no
traceback) when that starts, at most one every ``REPORT_EVERY_S`` while it
lasts, and one when accepting works again (``AcceptBackoff``). Other accept
errors propagate, as with ``trio.serve_listeners``.

The descriptors a server needs are about ``max_connections`` plus the
reserve over the cap plus ``FD_HEADROOM``; ``raise_fd_limit`` raises the
soft ``RLIMIT_NOFILE`` towards that (often 1024 by default, with a far
higher hard limit).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import trio

from trioserve.server.admission import OVER_CAP_SLOTS

log = logging.getLogger("trioserve.server")

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 1.0
REPORT_EVERY_S = 10.0  # while accept keeps failing, at most one log line this often
QUIET_S = 5.0  # an accept failure episode ends at a successful accept this long after its last failure
FD_HEADROOM = 128  # descriptors besides clients: the engine's sockets and pipes, listeners, logs

StreamT = TypeVar("StreamT", bound=trio.abc.AsyncResource)


@dataclass
class AcceptBackoff:
    """How long to wait after a failed accept, and what to log. Plain state,
    no I/O: the caller passes the time in.

    Failures come in episodes. One starts at a failure (one line); while it
    lasts, at most one line every ``REPORT_EVERY_S``; it ends (one line) at
    the first successful accept ``QUIET_S`` or more after its last failure,
    so an accept that flaps between failing and working near the limit
    stays one episode. Hence at most two lines per ``QUIET_S`` plus one per
    ``REPORT_EVERY_S``, whatever the load.
    """

    failures: int = 0  # in the current episode; 0: none
    delay: float = 0.0  # the last wait; 0 after a successful accept
    since: float = 0.0  # the episode's first failure
    last_failure: float = 0.0
    reported_at: float = 0.0

    def failed(self, now: float, error: OSError, num_open: int) -> tuple[float, str | None]:
        """Record a failed accept: the seconds to wait, and a line to log (None: stay quiet)."""
        code = error.errno if error.errno is not None else 0
        name = f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"
        self.delay = BACKOFF_MIN_S if self.delay == 0 else min(self.delay * 2, BACKOFF_MAX_S)
        self.failures += 1
        self.last_failure = now
        if self.failures == 1:
            self.since = self.reported_at = now
            return self.delay, (
                f"accept failed: {name}, with {num_open} client connections open; retrying with back-off "
                f"({BACKOFF_MIN_S * 1000:g} ms doubling to {BACKOFF_MAX_S:g} s) until it works again"
            )
        if now - self.reported_at >= REPORT_EVERY_S:
            self.reported_at = now
            return self.delay, (
                f"accept still failing: {name} {self.failures} times in {now - self.since:.0f} s, "
                f"with {num_open} client connections open"
            )
        return self.delay, None

    def succeeded(self, now: float) -> str | None:
        """Record a successful accept: a line to log if it ends an episode."""
        self.delay = 0.0
        if self.failures == 0 or now - self.last_failure < QUIET_S:
            return None
        line = (
            f"accept works again: it failed {self.failures} times over {self.last_failure - self.since:.1f} s, "
            f"the last {now - self.last_failure:.0f} s ago"
        )
        self.failures = 0
        return line


async def accept_loop(
    listener: trio.abc.Listener[StreamT], on_accept: Callable[[StreamT], object], num_open: Callable[[], int]
) -> NoReturn:
    """Accept connections until cancelled, handing each to ``on_accept``,
    which must not block (it starts the connection's task, which owns the
    stream from then on). ``num_open()`` is logged when accept fails.

    Raises accept errors other than running out of resources. If cancelled,
    the listener is closed; connections already handed over are left to
    their tasks.
    """
    backoff = AcceptBackoff()
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                delay, line = backoff.failed(trio.current_time(), exc, num_open())
                if line is not None:
                    log.warning("%s", line)
                await trio.sleep(delay)
                continue
            line = backoff.succeeded(trio.current_time())
            if line is not None:
                log.warning("%s", line)
            on_accept(stream)


def fds_needed(max_connections: int) -> int:
    """File descriptors a server with this cap may need."""
    return max_connections + OVER_CAP_SLOTS + FD_HEADROOM


def fd_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` (None where there is none, or it is unlimited)."""
    if sys.platform == "win32":
        return None
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_fd_limit(needed: int) -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to ``needed``, or as near as the hard
    limit allows; never lower it. Meant for a process the server owns (the CLI)."""
    if sys.platform == "win32":
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS caps it lower than it says
            log.debug("cannot raise RLIMIT_NOFILE to %d: %s", target, exc)
