"""A request's structured-output constraint, checked before it goes to an
engine: a schema, regex or grammar that cannot compile is refused here with
the grammar engine's reason, as bad input, rather than failing later inside
an engine core. The check runs in a worker thread (at most
``CHECK_THREADS`` at once) and is bounded by ``CHECK_TIMEOUT_S``: past it
the constraint is refused as too costly to compile."""

from __future__ import annotations

import trio

from trioserve.errors import InvalidRequestError
from trioserve.nurseries.engine_core.grammar import ConstraintError, check
from trioserve.structured import StructuredOutput

CHECK_THREADS = 2  # constraints checked at once, per engine
CHECK_TIMEOUT_S = 5.0  # the suite's schemas check in about a millisecond each


async def check_constraint_compiles(constraint: StructuredOutput, limiter: trio.CapacityLimiter) -> None:
    """Raise ``InvalidRequestError`` (field ``structured``) if ``constraint``
    does not compile, or its check takes longer than ``CHECK_TIMEOUT_S``.
    If cancelled, the thread's result is dropped when it ends."""
    with trio.move_on_after(CHECK_TIMEOUT_S):
        try:
            await trio.to_thread.run_sync(check, constraint, limiter=limiter, abandon_on_cancel=True)
        except ConstraintError as exc:
            raise InvalidRequestError("structured", str(exc)) from None
        return
    raise InvalidRequestError("structured", f"too costly: not compiled within {CHECK_TIMEOUT_S:g}s")
