"""Waiting in a test: on a condition, polled under a deadline (a fixed sleep
is no way to wait for something to have happened), and on a blocking call,
run in a thread.

``wait_until`` is for Trio code, ``poll_until`` for code that blocks (a
client in a thread, a plain test function). Both return the condition's
first true value, and fail after ``timeout`` seconds naming what they
waited for and what the condition last returned.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

POLL_INTERVAL_S = 0.02


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker thread, abandoned if the test is cancelled."""
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)


async def wait_until(
    condition: Callable[[], Any | Awaitable[Any]],
    timeout: float,
    what: str | None = None,
    *,
    interval: float = POLL_INTERVAL_S,
) -> Any:
    """Call ``condition`` (a function, or an async one) every ``interval``
    seconds until it returns something true, and return that. Fails with an
    ``AssertionError`` after ``timeout`` seconds of Trio's clock."""
    deadline = trio.current_time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if trio.current_time() >= deadline:
            raise AssertionError(_timed_out(condition, timeout, what, value))
        await trio.sleep(interval)


def poll_until(
    condition: Callable[[], Any],
    timeout: float,
    what: str | None = None,
    *,
    interval: float = POLL_INTERVAL_S,
) -> Any:
    """``wait_until`` for blocking code: the thread sleeps between calls."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(condition, timeout, what, value))
        time.sleep(interval)
    return value


def _timed_out(condition: Callable[..., Any], timeout: float, what: str | None, value: Any) -> str:
    if what is None:
        name = getattr(condition, "__qualname__", repr(condition))
        what = _source_of(condition) if name.endswith("<lambda>") else name
    return f"waited {timeout:g} s for {what}; it last gave {value!r}"


def _source_of(condition: Callable[..., Any]) -> str:
    """A lambda's line of source (its text, where it is written), else its name."""
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return repr(condition)
