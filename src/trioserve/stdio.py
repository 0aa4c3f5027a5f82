"""A process's standard descriptors, lines said on them that never stop
what they report, and the log level a child process takes.

A server's standard output and error are often pipes to a logger (``serve
2>&1 | tee log``, a supervisor's log collector) that may end or restart
before the server does: a line that cannot be written is dropped, never an
exception in the middle of a shutdown. ``ensure_standard_fds`` runs first in
every process of ours.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

LOG_LEVEL_ENV = "TRIOSERVE_LOG_LEVEL"  # the trioserve command's --log-level, for its children


def ensure_standard_fds() -> None:
    """Put ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed (a
    process started with ``>&-``, or by a daemonizer that closed them). Call
    it first, before anything opens a descriptor: the first socket, pipe or
    epoll a process opens takes the lowest free number, so what it or its
    children (which inherit 0, 1 and 2) then write to standard error would go
    into that socket (started with ``>&- 2>&-``, descriptor 2 would be a
    socket, and every child's standard error with it).
    Python's own stream stays None where the descriptor was closed at its
    start, so a command can still tell that its output would go nowhere
    (``generate >&-`` says so)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # closed
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, as lower ones are open
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # os.open's descriptors are not; the standard ones must be


def say(line: str) -> None:
    """``line`` on standard error, flushed; dropped where standard error is
    gone (its reader ended) or was closed at the start: with ``serve 2>&1 |
    tee log``, Ctrl-C ends tee too, and a ``BrokenPipeError`` from "SIGINT:
    shutting down" would cut the graceful shutdown short."""
    if sys.stderr is None:  # print would fall back to stdout
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # gone, or closed (ValueError: I/O operation on closed file)
        pass


def announce(line: str) -> None:
    """``line`` on standard output, flushed (``serving on ...``, which scripts
    read there); where standard output is gone or closed, on standard error
    instead, and standard output then points at ``/dev/null`` (``serve |
    true``: its reader is gone before it serves, and it must not exit without
    a word)."""
    try:
        if sys.stdout is not None:
            print(line, flush=True)
            return
    except (OSError, ValueError):
        drop_stdout()
    say(line)


def drop_stdout() -> None:
    """Point stdout at /dev/null, so that nothing written to it after a
    failure (the interpreter's flush at exit included: a traceback, exit
    120) fails again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no stdout (None), or it is closed
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


LOG_FORMAT_ENV = "TRIOSERVE_LOG_FORMAT"  # the trioserve command's --log-format, for its children
LOG_FORMATS = ("text", "json")
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601 with milliseconds),
    ``level``, ``logger``, ``process`` (the role: ``serve``, ``engine-core``...),
    ``pid``, ``message``; a record's ``fields`` (a dict: the access log's)
    are added as they are, and an exception as ``exception``."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": self.role,
            "pid": record.process,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: int | str, log_format: str, role: str) -> None:
    """The process's logging, on standard error: ``text`` lines with the
    date and time (milliseconds), level, ``role[pid]``, logger and message,
    or ``json`` (``JsonFormatter``). As ``logging.basicConfig``, it does
    nothing where logging is set up already (a test's capture)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s.%(msecs)03d %(levelname)s {role}[%(process)d] %(name)s: %(message)s", DATE_FORMAT
            )
        )
    logging.basicConfig(level=level, handlers=[handler])


def child_log_format() -> str:
    """The log format a child process takes from ``TRIOSERVE_LOG_FORMAT`` (text when unset or unknown)."""
    given = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower()
    return given if given in LOG_FORMATS else "text"


def child_log_level() -> int:
    """The log level a child process takes from ``TRIOSERVE_LOG_LEVEL``
    (any case); WARNING when it is unset or names no level (``logging`` takes
    only upper case: a ``debug`` would stop every child at its first line)."""
    level = logging.getLevelName(os.environ.get(LOG_LEVEL_ENV, "WARNING").strip().upper())
    return level if isinstance(level, int) else logging.WARNING
