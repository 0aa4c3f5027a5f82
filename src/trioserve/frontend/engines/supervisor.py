"""The front-end's supervisor of its engine core: restarts with backoff, within a budget.

Task tree (inside the caller's ``trio.run``)::

    EngineSupervisor.run
    └── generation nursery         one per engine-core life
        ├── EngineCoreClient.run   the engine-core process, its sockets, its requests
        └── death watch            a dead engine core that does not exit is stopped

Health moves ``starting`` -> ``ready`` (shown as ``stalled`` while a hang is
suspected: the engine core or a worker late with its heartbeat, or a step far
slower than usual); when the engine core dies (or is declared hung and killed), every
request in flight fails with ``EngineDeadError`` at once (its client does
that) and health turns ``restarting``; after a backoff a new engine core
(with new workers) is started, and health is ``ready`` again (or ``paused``,
``sleeping``, as it was). A death that
would exceed ``max_restarts`` within ``restart_window_s`` turns health
``failed`` for good: requests then fail at once, and ``wait_failed`` returns.
When the supervisor is cancelled (the engine is shut down), health is
``stopped``.

Paused and asleep are the engine core's word (``GenerationState``, with every
reply to a call and every heartbeat, to every front-end of it): ``health``
reads it, whichever API server paused or resumed. An engine core's next life
is put in the state its last one was in, by the supervisor that ``reapplies``
(the engine core's own front-end; not an attached API server of several, which
would only repeat it), and the pause, resume, sleep and wake-up calls asked
while no engine core lives are kept for the next.

The first start is not retried: a model that cannot load, or a deadline
missed on first start, is a configuration problem, raised to the caller as
``EngineStartupError``. A restart that fails to start counts against the
budget like any other death.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Literal

import trio

from trioserve.config import EngineConfig
from trioserve.errors import (
    ControlCallError,
    EngineDeadError,
    EngineFailedError,
    EngineStartupError,
    first_leaf,
    leaves,
)
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.local import LocalProcessStrategy
from trioserve.messages import EngineInfo, LoadReport, ModelInfo
from trioserve.rpc import AddLora, ControlCall, Pause, Resume, Sleep, SleepLevel, WakeUp

Health = Literal["starting", "ready", "stalled", "paused", "sleeping", "restarting", "failed", "stopped"]
# Makes the client of one engine-core life: (config, engine index, on_dead).
# Tests give a fake one to drive the supervisor on a virtual clock.
ClientFactory = Callable[[EngineConfig, int, Callable[[EngineCoreClient], None]], EngineCoreClient]


def new_client(
    config: EngineConfig, engine_index: int, on_dead: Callable[[EngineCoreClient], None]
) -> EngineCoreClient:
    """A local engine core's client: its process started here (``local.py``)."""
    return EngineCoreClient(config, engine_index, LocalProcessStrategy(), on_dead=on_dead)


log = logging.getLogger("trioserve.supervisor")


class EngineSupervisor:
    """Keeps engine core ``engine_index`` running (see the module docstring).
    ``on_load`` is told its load reports, and None when a new engine core
    takes its place."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        *,
        client_factory: ClientFactory = new_client,
        on_load: Callable[[int, LoadReport | None], None] | None = None,
        on_new_client: Callable[[EngineCoreClient], None] | None = None,
        on_engine_ready: Callable[[EngineCoreClient], None] | None = None,
        on_engine_dead: Callable[[EngineCoreClient], None] | None = None,
        on_failed: Callable[[EngineSupervisor], None] | None = None,
        remote: bool = False,
        reapplies: bool = True,
    ) -> None:
        self.config = config
        self.remote = remote  # an engine core on another host: it joins, it is not started here
        self.reapplies = reapplies  # puts a new life in the state the last one was in
        self.loras: dict[
            str, AddLora
        ] = {}  # LoRA adapters added while serving (Engine.add_lora): every life loads them
        self._client_factory = client_factory
        self._on_load = on_load
        self._on_new_client = on_new_client  # a new engine core's client, before it starts
        self._on_engine_ready = on_engine_ready  # an engine core ready, before requests are routed to it
        self._on_engine_dead = on_engine_dead  # an engine core known dead
        self._on_failed = on_failed  # out of restarts, for good
        self.engine_index = engine_index
        self.name = f"engine-core-{engine_index}"
        self._health: Health = "starting"
        self.client: EngineCoreClient | None = None  # the live engine core's, while ready
        self.info: EngineInfo | None = None  # the latest engine core's
        self._first_model: ModelInfo | None = None  # what the first life loaded: every later one must match
        self.num_restarts = 0
        self.failure: EngineDeadError | None = None
        self._deaths: deque[float] = deque()
        self._last_reason = "unknown"  # why the latest engine core died
        self._changed = trio.Event()
        # The pause and sleep a new engine core is put in: its last life's, and those asked while none lived.
        self._wanted: dict[type, ControlCall] = {}
        # Scaling (frontend/engines/scaling.py): routing passes a departing engine by; ``stop`` ends ``run``.
        self.departing = False
        self._stop_scope = trio.CancelScope()

    @property
    def health(self) -> Health:
        """The engine's state; while it is ready, ``stalled`` when a hang is
        suspected (see ``EngineCoreClient.stalled``), ``sleeping`` or
        ``paused`` when it was put to sleep or paused."""
        client = self.client
        if self._health != "ready" or client is None:
            return self._health
        if client.stalled:
            return "stalled"
        if client.state.sleep_level:
            return "sleeping"
        return "paused" if client.state.holding else "ready"

    @property
    def stalled(self) -> str:
        """Why a hang is suspected, or ``""``."""
        client = self.client
        return client.stalled if client is not None and self._health == "ready" else ""

    # --- life cycle ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine core and report its ``EngineInfo`` once it is ready;
        then keep one running until cancelled or out of restarts (then return,
        with health ``failed``). A failure of the first start raises
        ``EngineStartupError``. If cancelled, the engine core and its workers
        are stopped and reaped before this returns.
        """
        try:
            with self._stop_scope:
                if self.remote:
                    await self._run_remote(task_status)
                    return
                await self._start_first(task_status)
                while True:
                    if not self._may_restart():
                        return
                    await self._restart()
        finally:
            self.client = None
            if self._health != "failed":
                self._set_health("stopped")

    async def _start_first(self, task_status: trio.TaskStatus[EngineInfo]) -> None:
        """Run the first engine core until it dies. Raises ``EngineStartupError``
        if it cannot start."""
        started = False

        def ready(info: EngineInfo) -> None:
            nonlocal started
            started = True
            task_status.started(info)

        try:
            await self._run_generation(ready)
        except BaseExceptionGroup as group:
            error = _startup_error(group)
            if error is None or started:
                raise
            raise error from None

    async def _run_remote(self, task_status: trio.TaskStatus[EngineInfo]) -> None:
        """A remote engine core's lives, one after another, until cancelled.
        None is started here (its host's ``serve --headless`` does that), so
        none counts against the restart budget: health is ``starting`` until
        it first joins, ``restarting`` while it is away, and routing passes
        it by meanwhile; each later join counts as a restart. An attached
        API server's engine that its supervising process gave up on turns
        ``failed`` (then this returns). ``task_status`` hears of its first
        join."""
        reported = False

        def ready(info: EngineInfo) -> None:
            nonlocal reported
            if reported:
                self.num_restarts += 1  # a restart is a life that came up again, not a death
            else:
                reported = True
                task_status.started(info)

        while True:
            try:
                await self._run_generation(ready)
            except BaseExceptionGroup as group:
                if (failed := first_leaf(group, EngineFailedError)) is not None:
                    self.failure = EngineDeadError(str(failed))
                    log.error("%s: %s", self.name, failed)
                    self._set_health("failed")  # not "restarting": no restart will come
                    return
                error = _startup_error(group)
                if error is None:
                    raise
                log.warning("%s: a join failed: %s", self.name, error)
            if reported:
                self._set_health("restarting")
            await trio.sleep(self.config.restart_backoff_s)

    async def _restart(self) -> None:
        """Wait out the backoff, then run a new engine core until it dies.
        A failure to start is recorded as one more death."""
        delay = self._backoff()
        log.warning("%s: restarting in %.2fs (restart %d)", self.name, delay, self.num_restarts + 1)
        await trio.sleep(delay)
        self.num_restarts += 1
        try:
            await self._run_generation(lambda info: None)
        except BaseExceptionGroup as group:
            error = _startup_error(group)
            if error is None:
                raise
            log.error("%s: restart %d failed: %s", self.name, self.num_restarts, error)
            self._last_reason = str(error)

    async def _run_generation(self, on_ready: Callable[[EngineInfo], None]) -> None:
        """Start one engine core, mark it ready, and return when it died."""
        client = self._client_factory(self.config, self.engine_index, self._on_dead)
        if self._on_load is not None:
            self._on_load(self.engine_index, None)  # a new life: nothing of the last one's load holds
            client.on_load = self._on_load
        if self._on_new_client is not None:
            self._on_new_client(client)
        self._last_reason = "unknown"
        async with trio.open_nursery() as nursery:

            async def run_client(task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
                await client.run(task_status=task_status)
                # Reaped: the watch below has nothing left to wait for.
                nursery.cancel_scope.cancel()

            info: EngineInfo = await nursery.start(run_client)
            self._check_same_model(info)
            await self._reapply(client)
            if client.dead is not None:  # it died while being put in its state: it never served
                nursery.start_soon(self._stop_when_dead_but_running, client, nursery.cancel_scope)
                return
            if self._on_engine_ready is not None:
                self._on_engine_ready(client)
            self.client, self.info = client, info
            self._set_health("ready")
            on_ready(info)
            nursery.start_soon(self._stop_when_dead_but_running, client, nursery.cancel_scope)
        # client.run returned: its engine core died, and was reaped.
        self._last_reason = str(client.dead) if client.dead is not None else "it exited"

    def _check_same_model(self, info: EngineInfo) -> None:
        """A later life must have loaded the model the first one did (the
        front-end's tokenizer and checks are that one's); else that start
        fails, naming what changed. A model directory can be replaced under
        a running server (a ``current -> vN`` symlink moved, files updated in
        place); a restart must not serve another model through the first
        one's tokenizer."""
        if self._first_model is None:
            self._first_model = info.model
            return
        if info.model == self._first_model:
            return
        was, now = self._first_model, info.model
        changes = [
            f"{field} {getattr(was, field)} -> {getattr(now, field)}"
            for field in ("vocab_size", "max_model_len", "eos_token_ids")
            if getattr(was, field) != getattr(now, field)
        ]
        raise EngineStartupError(
            f"the model at {self.config.model!r} changed since the engine started ({', '.join(changes)}): "
            "not served through the first one's tokenizer; start the engine again to serve it",
            stage="model-load",
            process=self.name,
        )

    def stop(self) -> None:
        """End ``run`` (the group shrinks): its engine core and workers are
        stopped and reaped, and health turns ``stopped``. Never blocks."""
        self._stop_scope.cancel()

    async def wait_stopped(self) -> None:
        """Wait until ``run`` has ended (stopped, or failed for good)."""
        while self._health not in ("stopped", "failed"):
            await self._changed.wait()

    def remember(self, call: ControlCall) -> None:
        """Note a pause, resume, sleep or wake-up asked while no engine core
        lives (or while the next one is being put in its state), so that the
        next one is put in that state. A call cancels its opposite still to
        send (a resume a pause, a pause a resume; the same for sleep and
        wake-up); a resume or wake-up with nothing to cancel is sent too: the
        call it undoes may have gone out already."""
        if isinstance(call, Pause | Sleep | Resume | WakeUp):
            undone = {Pause: Resume, Resume: Pause, Sleep: WakeUp, WakeUp: Sleep}[type(call)]
            if self._wanted.pop(undone, None) is None or isinstance(call, Pause | Sleep):
                self._wanted[type(call)] = call

    def wanted(self) -> list[ControlCall]:
        """The pause, sleep and their undoing kept for the next life (none while one serves)."""
        return list(self._wanted.values())

    def state_changed(self) -> None:
        """Wake those waiting for a change: the engine was paused, resumed, put to sleep or woken."""
        self._changed.set()
        self._changed = trio.Event()

    async def _reapply(self, client: EngineCoreClient) -> None:
        """Load the LoRA adapters added while the last one served, and pause
        (or put to sleep) a new engine core as the last one was, or
        as asked meanwhile, before any request reaches it. A failure is
        logged: it serves then. From now on its own word is the state."""
        for added in list(self.loras.values()):  # the adapters loaded while it served, loaded again first
            try:
                await client.control(added, self.config.control_timeout_s)
            except EngineDeadError:
                return  # the next life loads them
            except ControlCallError as exc:
                log.error("%s: could not load LoRA adapter %r again: %s", self.name, added.name, exc)
        while self._wanted and client.dead is None:  # (calls asked meanwhile are remembered: sent too)
            wanted, self._wanted = list(self._wanted.values()), {}
            for call in wanted:
                try:
                    await client.control(call, self.config.control_timeout_s)
                except EngineDeadError:
                    # For the next life: these calls (those it answered died with it), then those asked
                    # meanwhile, in that order: a resume asked meanwhile must come after the pause it
                    # undoes, and a pause the dead life had answered must hold in the next.
                    meanwhile, self._wanted = list(self._wanted.values()), {}
                    for again in wanted + meanwhile:
                        self.remember(again)
                    return
                except ControlCallError as exc:
                    log.error("%s: could not %s the new engine core: %s", self.name, type(call).__name__, exc)

    def _on_dead(self, client: EngineCoreClient) -> None:
        """Called by the client the moment its engine core is known dead."""
        if client is self.client:
            self.client = None
            if self.reapplies:
                # The next life is put in this one's state as it last said, or as a pause or sleep it
                # was asked and died before answering would have left it (calls from now on count too).
                state = client.state
                self._wanted = {Pause: Pause()} if state.paused else {}
                if state.sleep_level:
                    level: SleepLevel = 1 if state.sleep_level == 1 else 2
                    self._wanted[Sleep] = Sleep(level=level)
                for call in client.asking:
                    if isinstance(call, Pause | Sleep):
                        self._wanted[type(call)] = call
            self._set_health("restarting")
        if self._on_engine_dead is not None:
            self._on_engine_dead(client)

    async def _stop_when_dead_but_running(self, client: EngineCoreClient, scope: trio.CancelScope) -> None:
        """An engine core that reported its death but does not exit is stopped
        (asked, then terminated, then killed) after the shutdown grace."""
        await client.wait_dead()
        await trio.sleep(self.config.shutdown_grace_s)
        scope.cancel()

    def _may_restart(self) -> bool:
        """Record a death; False (and health ``failed``) when the budget is spent."""
        now = trio.current_time()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.config.restart_window_s:
            self._deaths.popleft()
        if len(self._deaths) <= self.config.max_restarts:
            self._set_health("restarting")
            return True
        self.failure = EngineDeadError(
            f"{self.name} died {len(self._deaths)} time(s) within restart_window_s={self.config.restart_window_s}s "
            f"(max_restarts={self.config.max_restarts}); not restarting. Last: {self._last_reason}"
        )
        log.error("%s", self.failure)
        self._set_health("failed")
        if self._on_failed is not None:
            self._on_failed(self)
        return False

    def _backoff(self) -> float:
        exponent = max(len(self._deaths) - 1, 0)
        return min(self.config.restart_backoff_s * 2.0**exponent, self.config.restart_backoff_max_s)

    def _set_health(self, health: Health) -> None:
        if health != self._health:
            log.info("%s: %s -> %s", self.name, self._health, health)
        self._health = health
        self.state_changed()

    # --- for requests ---------------------------------------------------------

    async def ready_client(self) -> EngineCoreClient:
        """The live engine core's client. While the engine restarts, wait for it
        at most ``restart_wait_s``; then, or if the engine failed or stopped,
        raise ``EngineDeadError``. If cancelled, nothing is left behind."""
        with trio.move_on_after(self.config.restart_wait_s):
            while True:
                client = self.client
                if client is not None and client.dead is None:
                    return client
                if self._health == "failed":
                    assert self.failure is not None
                    raise self.failure
                if self._health == "stopped":
                    raise EngineDeadError(f"{self.name} is stopped")
                await self._changed.wait()
        raise EngineDeadError(
            f"{self.name} is restarting and was not ready within restart_wait_s={self.config.restart_wait_s}s"
        )

    def live_client(self) -> EngineCoreClient | None:
        """The live engine core's client, or None while there is none."""
        client = self.client
        return client if client is not None and client.dead is None else None

    async def wait_changed(self) -> None:
        """Wait until the health changes (or a new engine core is ready)."""
        await self._changed.wait()

    async def wait_failed(self) -> EngineDeadError:
        """Wait until the engine has failed for good (out of restarts); its
        error. Raises ``EngineDeadError`` if it is stopped instead (then it
        never fails)."""
        while self.failure is None:
            if self._health == "stopped":
                raise EngineDeadError(f"{self.name} is stopped")
            await self._changed.wait()
        return self.failure

    async def wait_health(self, *wanted: Health) -> None:
        """Wait until health is one of ``wanted``."""
        while self._health not in wanted:
            await self._changed.wait()


def _startup_error(group: BaseExceptionGroup[BaseException]) -> EngineStartupError | None:
    """The ``EngineStartupError`` that ``group`` is about, if that is all it
    holds (a cancellation beside it means the start was not what failed)."""
    found = leaves(group)
    first = found[0]
    if isinstance(first, EngineStartupError) and all(isinstance(leaf, EngineStartupError) for leaf in found):
        return first
    return None
