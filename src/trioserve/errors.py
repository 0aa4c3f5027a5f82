"""The exceptions trioserve raises at its public boundary, and the one
place that flattens exception groups.

Inside the project, nurseries are strict and failures travel as exception
groups. ``leaves``, ``describe`` and ``collapse`` are the only code that
takes groups apart: the engine core uses them to report a failure, the
public boundaries (``open_engine``, ``Server.run``) to raise the one
exception a caller should see.
"""

from __future__ import annotations

import signal
import traceback
from typing import Literal, TypeVar

# Where an engine start-up failed: the front-end loading the tokenizer, a
# process being spawned, the engine core's handshake, the workers loading the
# model, the KV cache being allocated.
StartupStage = Literal["tokenizer", "spawn", "handshake", "model-load", "kv-cache"]


class TrioserveError(Exception):
    """Base class for trioserve's own errors."""


class EngineStartupError(TrioserveError):
    """The engine could not start. ``stage`` names the start-up step that
    failed, ``process`` the process, and ``exit_code`` its exit status when
    it exited (negative: the signal that killed it)."""

    def __init__(self, message: str, *, stage: StartupStage, process: str = "", exit_code: int | None = None):
        super().__init__(message)
        self.stage: StartupStage = stage
        self.process = process
        self.exit_code = exit_code


class EngineDeadError(TrioserveError):
    """The engine core (or one of its workers) died; the request cannot finish."""


class EngineFailedError(EngineDeadError):
    """The engine failed for good (out of restarts), as its supervising
    process says to an attached API server."""


class RequestError(TrioserveError):
    """A request failed for a reason of its own (not bad input: that is
    ``ValueError``)."""


class StoppedBySignal(TrioserveError):
    """A SIGTERM or SIGHUP (``signum``) stopped something that has no graceful
    shutdown of its own: a model being built on first use, a benchmark's
    baseline or its engine run. It was stopped and cleaned up, as asked.
    The message starts with the signal's name."""

    def __init__(self, signum: int, what: str) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name}: {what}")


class ControlCallError(TrioserveError):
    """A control call (``pause``, ``sleep``, ``collective_rpc``...) failed or
    was not answered in time; the message names the engine core and, when a
    worker raised, its rank. The engine serves on. ``restarting``: it failed
    only for engine cores that were restarting (asked through one of several
    API servers): asked again once they are up, it may succeed."""

    def __init__(self, message: str, *, restarting: bool = False) -> None:
        super().__init__(message)
        self.restarting = restarting


class EngineOverloadedError(RequestError):
    """The engine holds as many waiting requests as it may
    (``EngineConfig.max_waiting_requests``): the request was not taken.
    Retry later."""


class InvalidRequestError(ValueError):
    """A request that can never run, named by its ``field`` (``prompt``,
    ``params.max_tokens``...). The message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the context, which must also hold at least
    one output token."""


_E = TypeVar("_E", bound=BaseException)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc`` (itself, if it is not a group), depth first."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def meaningful_leaves(exc: BaseException) -> list[BaseException]:
    """The leaves of ``exc`` that are not a cancellation's ``Cancelled``."""
    import trio  # the core layers import this module too; only callers under Trio reach here

    return [leaf for leaf in leaves(exc) if not isinstance(leaf, trio.Cancelled)]


def first_leaf(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first leaf of ``exc`` that is a ``kind``, or None."""
    return next((leaf for leaf in leaves(exc) if isinstance(leaf, kind)), None)


def sole_leaf(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first leaf of ``exc`` when every leaf but cancellations is a
    ``kind`` (the failure is only that), else None."""
    meaningful = meaningful_leaves(exc)
    if meaningful and all(isinstance(leaf, kind) for leaf in meaningful):
        return first_leaf(exc, kind)
    return None


def only_the_callers(group: BaseExceptionGroup, own: BaseException) -> bool:
    """True when ``group`` (a nursery's) holds nothing but ``own``, the
    caller's exception, beside cancellations: itself, or, for a group of
    the caller's, the copy Trio made of it (the same leaves)."""
    import trio  # as in meaningful_leaves

    others = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
    if len(others) != 1:
        return False
    return others[0] is own or (isinstance(own, BaseExceptionGroup) and leaves(others[0]) == leaves(own))


def describe(exc: BaseException) -> str:
    """One line per meaningful leaf, joined with "; ": our own errors by their
    message (it names what failed), others as ``Type: message``."""
    return "; ".join(_describe_one(leaf) for leaf in meaningful_leaves(exc))


def _describe_one(exc: BaseException) -> str:
    if type(exc).__module__.startswith("trioserve.") and str(exc):
        return str(exc)
    return "".join(traceback.format_exception_only(exc)).strip()


def collapse(exc: BaseException) -> BaseException:
    """The single exception a caller should see for ``exc``: its one
    meaningful leaf; a ``Cancelled`` when it holds nothing else; one
    ``EngineStartupError`` naming each when several engines failed to start
    at once (with the first's stage, process and exit code); the group
    itself when several other things went wrong."""
    meaningful = meaningful_leaves(exc)
    if len(meaningful) == 1:
        return meaningful[0]
    if not meaningful:
        return leaves(exc)[0]
    if all(isinstance(leaf, EngineStartupError) for leaf in meaningful):
        first = meaningful[0]
        assert isinstance(first, EngineStartupError)
        return EngineStartupError(
            "; ".join(str(leaf) for leaf in meaningful),
            stage=first.stage,
            process=first.process,
            exit_code=first.exit_code,
        )
    return exc
