"""One engine shared by several tests: ``open_engine`` in a thread of its own.

pytest-trio gives every test its own ``trio.run``, so an engine cannot
outlive a test there. ``HostedEngine`` runs ``open_engine`` in a background
thread's ``trio.run`` instead; a test (a plain function) runs a scenario
there with ``call``, each bounded by ``trio.fail_after``. ``close`` shuts
the engine down and reaps every process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

import trioserve
from trioserve import EngineConfig

T = TypeVar("T")


class HostedEngine:
    def __init__(self, config: EngineConfig, *, start_bound_s: float = 120.0) -> None:
        self.config = config
        self.engine: trioserve.Engine | None = None
        self.error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hosted-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_bound_s):
            raise AssertionError(f"open_engine did not start within {start_bound_s}s")
        if self.error is not None:
            raise AssertionError(f"open_engine failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by the constructor or close()
            self.error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trioserve.open_engine(config=self.config) as engine:
            self.engine = engine
            self._ready.set()
            await self._stop.wait()

    def call(self, scenario: Callable[[trioserve.Engine], Awaitable[T]], bound_s: float = 60.0) -> T:
        """Run ``scenario(engine)`` in the engine's thread, within ``bound_s``."""

        async def bounded() -> T:
            assert self.engine is not None
            with trio.fail_after(bound_s):
                return await scenario(self.engine)

        return trio.from_thread.run(bounded, trio_token=self._token)

    def close(self, bound_s: float = 30.0) -> None:
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(bound_s)
        if self._thread.is_alive():
            raise AssertionError("the hosted engine did not shut down")
        if self.error is not None:
            raise AssertionError(f"the hosted engine failed: {self.error!r}") from self.error
