"""The exit statuses of ``trioserve`` (``cli/exits.py``): one table, the
same as docs/supervision.md's, and the exception that ends a command with each."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from trioserve.chat import StdioError
from trioserve.cli.exits import EXITS, exit_for
from trioserve.errors import (
    EngineDeadError,
    EngineFailedError,
    EngineOverloadedError,
    EngineStartupError,
    InvalidRequestError,
    StoppedBySignal,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "supervision.md"


def documented_statuses() -> set[int]:
    section = DOCS.read_text().split("## Exit codes of `trioserve`", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if re.match(r"\| \d", line)]
    return {int(code) for row in rows for code in re.findall(r"\d+", row)}


def test_the_docs_list_every_exit_status_of_the_table():
    table = {row.code for row in EXITS}
    signalled = {128 + signal.SIGHUP, 128 + signal.SIGTERM}  # the table's row 128 + N
    assert documented_statuses() == table - {128} | signalled


@pytest.mark.parametrize(
    ("exc", "status", "line"),
    [
        (ValueError("x"), 2, "trioserve: invalid input: x"),
        (InvalidRequestError("prompt", "x"), 2, "trioserve: invalid input: prompt: x"),
        (EngineStartupError("x", stage="spawn"), 3, "trioserve: the engine could not start: "),
        (EngineFailedError("x"), 4, "trioserve: the engine died and was not recovered: x"),
        (EngineDeadError("x"), 4, "trioserve: the engine died and was not recovered: x"),
        (EngineOverloadedError("x"), 1, "trioserve: EngineOverloadedError: x"),
        (StoppedBySignal(signal.SIGTERM, "stopped"), 143, "trioserve: SIGTERM: stopped"),
        (StoppedBySignal(signal.SIGHUP, "stopped"), 129, "trioserve: SIGHUP: stopped"),
        (KeyboardInterrupt(), 130, "\ntrioserve: interrupted"),
        (BrokenPipeError(), 1, ""),
        (StdioError("cannot write to stdout: gone"), 1, "trioserve: cannot write to stdout: gone"),
    ],
)
def test_each_exception_ends_a_command_with_its_status(exc, status, line):
    found = exit_for(exc, graceful=False)
    assert found is not None and found[0] == status and found[1].startswith(line), found


def test_a_graceful_command_exits_0_on_every_signal_and_the_same_otherwise():
    assert exit_for(StoppedBySignal(signal.SIGHUP, "stopped"), graceful=True) == (0, "trioserve: SIGHUP: stopped")
    assert exit_for(KeyboardInterrupt(), graceful=True) == (0, "\ntrioserve: SIGINT: stopped before serving")
    assert exit_for(ValueError("x"), graceful=True) == (2, "trioserve: invalid input: x")


def test_an_exception_no_row_names_propagates():
    assert exit_for(OSError("x"), graceful=False) is None
    assert exit_for(RuntimeError("x"), graceful=True) is None
