"""The ``trioserve`` command line: ``main`` (also ``python -m trioserve.cli``).

Its commands: ``serve`` (``cli/serve.py``; ``--headless`` and ``keys`` in
``cli/hosts.py``), ``generate`` and ``chat`` (``cli/terminal.py``), ``bench``
(``bench/cli.py``). The engine options they share are in
``engine_options.py``; the exit statuses, and which exception ends a
command with which, in ``cli/exits.py``; the shell that runs a server until
a signal stops it in ``cli/signals.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
import threading

from trioserve.bench.cli import add_bench_parser
from trioserve.chat import StdioError
from trioserve.cli.exits import (
    EXIT_ENGINE_DEAD,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SIGNALLED_BASE,
    EXIT_STARTUP_FAILED,
    EXIT_USAGE,
    exit_for,
)
from trioserve.cli.hosts import add_keys_parser
from trioserve.cli.quantize import add_quantize_parser
from trioserve.cli.serve import add_serve_parser
from trioserve.cli.terminal import add_chat_parser, add_generate_parser
from trioserve.cli.vllm_flags import unsupported_flag
from trioserve.errors import collapse
from trioserve.server.listener import fd_limit, raise_fd_limit
from trioserve.stdio import LOG_FORMAT_ENV, LOG_LEVEL_ENV, configure_logging, drop_stdout, ensure_standard_fds, say

__all__ = [
    "EXIT_ENGINE_DEAD",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SIGNALLED_BASE",
    "EXIT_STARTUP_FAILED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

# Below this many open files, the engine's start fails in zmq (the fake runner's tree needs 28; a worker
# with torch, more): refused at once, naming the limit.
MIN_OPEN_FILES = 64


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trioserve",
        description="Serve large language models with continuous batching, on Trio.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(commands)
    add_serve_parser(commands)
    add_keys_parser(commands)
    add_chat_parser(commands)
    add_bench_parser(commands)
    add_quantize_parser(commands)
    return parser


def command() -> int:
    """The ``trioserve`` command's entry point (its console script and
    ``python -m trioserve.cli``): ``main`` in a process that exits when it
    returns, so the signals it has taken stay ignored to the end (``main``'s
    putting back the default handlers would let a second Ctrl-C or SIGTERM,
    close behind the first, kill the process as it exits)."""
    return main(restore_signals=False)


def main(argv: list[str] | None = None, *, restore_signals: bool = True) -> int:
    """The ``trioserve`` command: its exit code. A closed standard
    descriptor gets ``/dev/null`` (``ensure_standard_fds``). SIGINT is
    honoured in every phase, even when this process was started with it
    ignored (a background job of a script, ``nohup``): ``kill -INT`` then
    means what it says, also while ``serve`` converts the default model,
    before it serves. On return, with ``restore_signals``, the signals'
    handlers are what they were (a stop leaves its signals ignored,
    ``supervision.oneshot.ignored_after_close``): for a caller in this
    process, a test."""
    ensure_standard_fds()  # before anything opens a descriptor
    honoured = threading.current_thread() is threading.main_thread()
    restored = (signal.SIGTERM, signal.SIGHUP) if honoured and restore_signals else ()
    found = {signum: signal.getsignal(signum) for signum in restored}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if honoured else None
    strict = _replace_unencodable(sys.stdout)
    try:
        return _main(argv)
    finally:
        if restore_signals and previous is not None:  # None: a handler installed from C, which we cannot put back
            signal.signal(signal.SIGINT, previous)
        for signum, handler in found.items():  # a caller in this process (a test) must not keep them ignored
            if handler is not None:
                signal.signal(signum, handler)
        if strict and isinstance(sys.stdout, io.TextIOWrapper):
            with contextlib.suppress(OSError, ValueError):  # it flushes: its reader may be gone
                sys.stdout.reconfigure(errors="strict")


def _replace_unencodable(stream: object) -> bool:
    """Let ``stream`` (stdout) write ``?`` for a character its encoding lacks
    (a Latin-1 or ASCII locale, ``PYTHONIOENCODING=ascii``); True when it was
    strict, so that ``generate`` and ``chat`` do not end at the first such
    character of the model's text."""
    if not isinstance(stream, io.TextIOWrapper) or stream.errors != "strict":
        return False
    stream.reconfigure(errors="replace")
    return True


def _main(argv: list[str] | None) -> int:
    if (line := unsupported_flag(sys.argv[1:] if argv is None else argv)) is not None:
        say(line)
        return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    args.log_level = getattr(args, "log_level", "WARNING")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        say(f"trioserve: invalid input: --log-level: unknown level {args.log_level!r}")
        return EXIT_USAGE
    log_format = getattr(args, "log_format", "text")
    configure_logging(args.log_level.upper(), log_format, args.command or "trioserve")
    os.environ[LOG_LEVEL_ENV] = args.log_level.upper()  # its children's, over one in the environment
    os.environ[LOG_FORMAT_ENV] = log_format
    raise_fd_limit(MIN_OPEN_FILES)  # the process is ours
    if args.command != "keys" and (limit := fd_limit()) is not None and limit < MIN_OPEN_FILES:
        say(
            f"trioserve: the open-files limit (RLIMIT_NOFILE) is {limit}, below the {MIN_OPEN_FILES} that "
            f"an engine needs to start: raise 'ulimit -n'"
        )
        return EXIT_ERROR
    try:
        try:
            code: int = args.func(args)
        except BaseExceptionGroup as group:  # from the commands' own nurseries (chat's, bench's)
            raise collapse(group) from None
        return code
    except (Exception, KeyboardInterrupt) as exc:
        ending = exit_for(exc, graceful=args.command == "serve")  # serve's every stop by a signal is graceful
        if ending is None:
            raise
        status, line = ending
        if line:
            say(line)
        if isinstance(exc, BrokenPipeError | StdioError):  # stdout is gone; the engine has stopped
            drop_stdout()
        return status
