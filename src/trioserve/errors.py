"""The exceptions trioserve raises at its public boundary.

Inside the project, nurseries are strict and failures travel as exception
groups; they are collapsed into these types in one place, where they reach
the caller.
"""

from __future__ import annotations


class TrioserveError(Exception):
    """Base class for trioserve's own errors."""


class EngineStartupError(TrioserveError):
    """The engine could not start. ``stage`` names the start-up step that failed
    (``spawn``, ``handshake``, ``model-load``, ``kv-cache``), ``process`` the
    process, and ``exit_code`` its exit status when it exited (negative: the
    signal that killed it)."""

    def __init__(self, message: str, *, stage: str, process: str = "", exit_code: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.process = process
        self.exit_code = exit_code


class EngineDeadError(TrioserveError):
    """The engine core (or one of its workers) died; the request cannot finish."""


class RequestError(TrioserveError):
    """A request failed for a reason of its own (not bad input: that is
    ``ValueError``)."""
