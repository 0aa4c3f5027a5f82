"""The shell that runs a server (serve, headless engine cores, several API
servers) until a signal stops it: ``run_until_signalled``."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import trio

from trioserve.nurseries.supervision.oneshot import ignored_after_close, stop_signals
from trioserve.stdio import say


def shutdown_signals() -> tuple[signal.Signals, ...]:
    """What shuts a server down gracefully (serve, headless, several API
    servers): Ctrl-C, and ``stop_signals()``: a SIGTERM, or a SIGHUP (its
    terminal closed: streams must not be cut short) unless it was started
    under ``nohup``."""
    return (signal.SIGINT, *stop_signals())


async def run_until_signalled(
    run: Callable[[trio.Nursery], Awaitable[object]],
    on_signal: Callable[[trio.Nursery], object],
    *,
    doing: str,
) -> None:
    """``run(nursery)`` until it returns, and then everything else in
    ``nursery`` is cancelled. Each of the ``shutdown_signals()`` is said
    ("trioserve: SIGTERM: ``doing``") and handed to ``on_signal(nursery)``,
    which stops the run: gracefully (a server's shutdown, which a second
    signal cuts short) or at once (``nursery.cancel_scope.cancel()``, then
    every process started is stopped and reaped). The signals stay ignored
    after this returns (``ignored_after_close``), until ``main`` restores
    them. What ``run`` raises is raised as it is, not in a group."""
    failure: list[Exception] = []
    with trio.open_signal_receiver(*ignored_after_close(shutdown_signals())) as signals:
        async with trio.open_nursery() as nursery:

            async def take_signals() -> None:
                async for signum in signals:
                    say(f"trioserve: {signal.Signals(signum).name}: {doing}")
                    on_signal(nursery)

            async def run_then_stop() -> None:
                try:
                    await run(nursery)
                except Exception as exc:
                    failure.append(exc)
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(take_signals)
            nursery.start_soon(run_then_stop)
    if failure:
        raise failure[0]
