"""One engine, or one server, shared by several tests: ``open_engine`` (or
``helpers.server.serving``) in a thread of its own.

pytest-trio gives every test its own ``trio.run``, so an engine cannot
outlive a test there. ``HostedEngine`` runs ``open_engine`` in a background
thread's ``trio.run`` instead; a test (a plain function) runs a scenario
there with ``call``, each bounded by ``trio.fail_after``. ``close`` shuts
the engine down and reaps every process. ``HostedServer`` does the same
for a server on the fake runner or a real model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import trio
from helpers.fakes import wait_no_children
from helpers.server import serving

import trioserve
from trioserve import EngineConfig
from trioserve.server import Server

T = TypeVar("T")
R = TypeVar("R")


class _Hosted(Generic[R]):
    """What ``_open`` yields, held open in a background thread's ``trio.run``."""

    def __init__(self, *, start_bound_s: float) -> None:
        self._resource: R | None = None
        self.error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hosted-{type(self).__name__}", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_bound_s):
            raise AssertionError(f"{type(self).__name__} did not start within {start_bound_s}s")
        if self.error is not None:
            raise AssertionError(f"{type(self).__name__} failed to start: {self.error!r}") from self.error

    def _open(self) -> AbstractAsyncContextManager[R]:
        raise NotImplementedError

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
        async with self._open() as resource:
            self._resource = resource
            self._ready.set()
            await self._stop.wait()

    def call(self, scenario: Callable[[R], Awaitable[T]], bound_s: float = 60.0) -> T:
        """Run ``scenario(what is hosted)`` in its thread, within ``bound_s``."""

        async def bounded() -> T:
            assert self._resource is not None
            with trio.fail_after(bound_s):
                return await scenario(self._resource)

        return trio.from_thread.run(bounded, trio_token=self._token)

    def close(self, bound_s: float = 30.0) -> None:
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(bound_s)
        if self._thread.is_alive():
            raise AssertionError(f"the hosted {type(self).__name__} did not shut down")
        if self.error is not None:
            raise AssertionError(f"the hosted {type(self).__name__} failed: {self.error!r}") from self.error


H = TypeVar("H", bound=_Hosted[Any])


def held(host: H) -> Iterator[H]:
    """``host`` for a fixture to yield from: closed after its tests, and then no
    process of this test process's is left (``yield from held(HostedEngine(...))``)."""
    yield host
    host.close()
    assert trio.run(wait_no_children) == []


class HostedEngine(_Hosted[trioserve.Engine]):
    def __init__(self, config: EngineConfig, *, start_bound_s: float = 120.0) -> None:
        self.config = config
        super().__init__(start_bound_s=start_bound_s)

    @property
    def engine(self) -> trioserve.Engine | None:
        return self._resource

    def _open(self) -> AbstractAsyncContextManager[trioserve.Engine]:
        return trioserve.open_engine(config=self.config)

    async def run(self, scenario: Callable[[trioserve.Engine], Awaitable[T]], bound_s: float = 60.0) -> T:
        """From a Trio test: ``scenario(engine)`` in the engine's thread, within ``bound_s``."""
        return await trio.to_thread.run_sync(self.call, scenario, bound_s)


class HostedServer(_Hosted[Server]):
    """``serving(config, **options)``; ``url`` and ``http_url`` are its addresses."""

    def __init__(self, config: EngineConfig, *, start_bound_s: float = 120.0, **options: Any) -> None:
        self.config = config
        self.options = options
        super().__init__(start_bound_s=start_bound_s)
        assert self._resource is not None
        self.url = self._resource.url
        self.http_url = self._resource.http_url

    def _open(self) -> AbstractAsyncContextManager[Server]:
        return serving(self.config, **self.options)

    async def run_fresh(self, scenario: Callable[[Server], Awaitable[None]], bound_s: float = 60.0) -> None:
        """From a Trio test: ``scenario(server)`` in the server's thread,
        within ``bound_s``; its prefix cache emptied first, as on a new server."""

        async def fresh(server: Server) -> None:
            assert server.engine is not None
            await server.engine.reset_prefix_cache()
            await scenario(server)

        await trio.to_thread.run_sync(self.call, fresh, bound_s)
