"""The exit statuses of the ``trioserve`` command, as one table: each
status, what it means, and the exceptions that end a command with it
(docs/supervision.md lists the same)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trioserve.chat import StdioError
from trioserve.errors import EngineDeadError, EngineStartupError, StoppedBySignal, TrioserveError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STARTUP_FAILED = 3
EXIT_ENGINE_DEAD = 4
EXIT_INTERRUPTED = 130
EXIT_SIGNALLED_BASE = 128  # + the signal's number


@dataclass(frozen=True)
class Exit:
    """An exit status: what it means, and each exception that ends a
    command with it, with the line said then ("" for none; ``{exc}`` is
    the exception's text, ``{name}`` its class's name)."""

    code: int
    meaning: str
    raised: dict[type[BaseException], str] = field(default_factory=dict)


EXITS = (
    Exit(EXIT_OK, "done, or shut down cleanly (serve: by SIGINT, SIGTERM or SIGHUP, whatever it was doing)"),
    Exit(
        EXIT_ERROR,
        "another error: cannot listen on the address, a request failed, standard output cannot be written",
        {
            TrioserveError: "trioserve: {name}: {exc}",
            BrokenPipeError: "",  # whoever read the output stopped (`trioserve generate ... | head`)
            StdioError: "trioserve: {exc}",  # a full disk, a terminal gone
        },
    ),
    Exit(EXIT_USAGE, "bad command line or configuration", {ValueError: "trioserve: invalid input: {exc}"}),
    Exit(
        EXIT_STARTUP_FAILED,
        "the engine could not start (the message names the stage, the process and its exit code)",
        {EngineStartupError: "trioserve: the engine could not start: {exc}"},
    ),
    Exit(
        EXIT_ENGINE_DEAD,
        "the engine died and could not be restarted (out of restarts)",
        {EngineDeadError: "trioserve: the engine died and was not recovered: {exc}"},
    ),
    Exit(
        EXIT_INTERRUPTED,
        "Ctrl-C where no graceful shutdown applies",
        {KeyboardInterrupt: "\ntrioserve: interrupted"},
    ),
    Exit(
        EXIT_SIGNALLED_BASE,
        "+ N: signal N (SIGHUP 129, SIGTERM 143) where no graceful shutdown applies; what the command started "
        "(an engine, a model build, a baseline) was stopped in order first",
        # A SIGTERM or SIGHUP while a model was built, or bench ran an engine or a baseline.
        {StoppedBySignal: "trioserve: {exc}"},
    ),
)

# A command whose every stop by a signal is graceful (serve) exits EXIT_OK instead, saying this.
GRACEFUL_STOPS: dict[type[BaseException], str] = {
    # serve's own SIGINT handler runs only once it serves; before, a model build was stopped in order.
    KeyboardInterrupt: "\ntrioserve: SIGINT: stopped before serving",
    StoppedBySignal: "trioserve: {exc}",
}


def exit_for(exc: BaseException, *, graceful: bool) -> tuple[int, str] | None:
    """The exit status and the line to say ("" for none) when ``exc`` ended
    a command (the row of its most specific class that has one); None when
    no row names it (a bug: it propagates). ``graceful``: the command stops
    gracefully on every signal (``GRACEFUL_STOPS``)."""
    for cls in type(exc).__mro__:
        if graceful and cls in GRACEFUL_STOPS:
            return EXIT_OK, GRACEFUL_STOPS[cls].format(exc=exc, name=type(exc).__name__)
        for row in EXITS:
            if cls in row.raised:
                code = row.code + exc.signum if isinstance(exc, StoppedBySignal) else row.code
                return code, row.raised[cls].format(exc=exc, name=type(exc).__name__)
    return None
