"""Elastic data parallelism: the engine group grown or shrunk while it serves
(``EngineGroup.scale``, ``Engine.scale``, ``POST /scale_elastic_ep``).

The routing's picture changes first, then the engine cores (docs/architecture.md
draws it as a state diagram):

- **Growing** N -> M: engines N .. M-1 are added to the group and started at
  once, each with its own deadlines. Routing passes an engine by until it is
  ready; from then on it takes new requests like the others (with no load,
  it is the least loaded). Once all are ready the group's size is M. If one
  cannot start, the new ones are drained and stopped again, and the size
  stays N (``ControlCallError`` naming the start-up error).
- **Shrinking** N -> M: engines M .. N-1 are *departing*: from that moment
  routing never chooses them. Their requests run to their end, for at most
  ``drain_timeout_s``; those left then end with ``EngineDeadError`` saying
  so (and are aborted in their engine core). Then the engines are stopped,
  their processes and workers reaped, and the size is M.
- **Lockstep** (``data_parallel_lockstep``): every engine's steps join one
  collective of a fixed size, so the group re-forms between waves: every
  engine departs (new requests wait, as for a restart, at most
  ``restart_wait_s``), the requests drain as above (so the last wave ends),
  the engines are stopped, and a new generation of M starts with a
  collective of its own. The coordinator's wave number goes on from where
  it was. If the new generation cannot start, the old size is started again
  and the error raised.

Refused at once, changing nothing (``InvalidRequestError`` naming
``data_parallel_size``, or ``ControlCallError`` for a scale under way): a
scale while another runs; a size below 1 or above ``MAX_ENGINES``; a group
with engines on other hosts (they join from their own hosts, which this
process cannot start; engines placed by Ray it places itself, so those
scale) or with several API servers.

A scale runs in the group's nursery, not the caller's: a caller that is
cancelled stops waiting, and the scale goes on to its end.

Invariants: ``supervisors[i].engine_index == i``; routing never chooses a
departing engine; the coordinator's picture has one entry per supervisor;
``config.data_parallel_size`` is the size the group has, or is growing to.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from trioserve.config import EngineConfig
from trioserve.errors import ControlCallError, EngineDeadError, EngineStartupError, InvalidRequestError
from trioserve.frontend.engines.coordinator import Coordinator
from trioserve.frontend.engines.remote import RemoteEngines
from trioserve.frontend.engines.supervisor import EngineSupervisor
from trioserve.rpc import AddLora, ControlCall, Pause, Sleep


class ScalableGroup(Protocol):
    """What scaling reads and changes of the engine group (``group.py``'s ``EngineGroup``)."""

    config: EngineConfig
    supervisors: list[EngineSupervisor]
    coordinator: Coordinator
    nursery: trio.Nursery | None  # where the supervisors run
    generation: int  # lockstep: the engines' current collective
    lockstep: bool

    @property
    def remote(self) -> object | None: ...  # the hub of engines on other hosts

    @property
    def several_api_servers(self) -> bool: ...

    def new_supervisor(self, i: int) -> EngineSupervisor: ...


MAX_ENGINES = 64  # EngineConfig.data_parallel_size's own bound
DRAIN_POLL_S = 0.05  # how often a drain looks at the departing engines' requests
log = logging.getLogger("trioserve.scaling")


class Scaling:
    """One engine group's scaling: at most one scale at a time."""

    def __init__(self, group: ScalableGroup) -> None:
        self._group = group
        self.target: int | None = None  # the size a scale under way goes to
        self._changed = trio.Event()

    @property
    def under_way(self) -> bool:
        return self.target is not None

    async def wait_changed(self) -> None:
        """Wait until the group's engines change (a scale starts, swaps them, or ends)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def routable(self, engine_index: int) -> EngineSupervisor:
        """Engine ``engine_index``'s supervisor, for a request sent to it by
        index; ``InvalidRequestError`` when there is no such engine, or it is
        departing."""
        supervisors = self._group.supervisors
        if not 0 <= engine_index < len(supervisors):
            raise InvalidRequestError("engine_index", f"must be an engine index in [0, {len(supervisors)}) or None")
        supervisor = supervisors[engine_index]
        if supervisor.departing:
            raise InvalidRequestError(
                "engine_index", f"{supervisor.name} is being removed (the engines scale to {self.target})"
            )
        return supervisor

    def check(self, size: object, drain_timeout_s: object) -> None:
        """Refuse a scale that cannot be done, naming why; nothing changes."""
        group = self._group
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_ENGINES:
            raise InvalidRequestError("data_parallel_size", f"must be an integer in [1, {MAX_ENGINES}] (got {size!r})")
        if (
            not isinstance(drain_timeout_s, int | float)
            or isinstance(drain_timeout_s, bool)
            or not drain_timeout_s >= 0
        ):
            raise InvalidRequestError("drain_timeout_s", f"must be a number of seconds >= 0 (got {drain_timeout_s!r})")
        on_ray = group.config.data_parallel_backend == "ray"  # (placed from here: they scale as local ones)
        if not on_ray and (group.config.num_remote_engines or group.remote is not None):
            raise InvalidRequestError(
                "data_parallel_size",
                "engines on other hosts (--headless) join from their own hosts: this front-end cannot start or "
                "stop them; change --data-parallel-size-local there instead",
            )
        if group.several_api_servers:
            raise InvalidRequestError("data_parallel_size", "cannot change with several API servers yet")
        if self.target is not None:
            raise ControlCallError(f"a scale to {self.target} engines is under way: ask again once it is done")
        if group.nursery is None:
            raise ControlCallError("the engines are not running")

    async def scale(self, size: int, drain_timeout_s: float) -> None:
        """Scale the group to ``size`` engines (see the module docstring);
        return once done. Raises what ``check`` raises, changing nothing, or
        ``ControlCallError`` when new engines could not start (the group is
        then as it was). If cancelled, the scale goes on without its caller."""
        self.check(size, drain_timeout_s)
        group = self._group
        assert group.nursery is not None
        if size == len(group.supervisors):
            return
        self.target = size
        self._notify()
        done = trio.Event()
        failure: list[BaseException] = []

        async def run() -> None:
            try:
                await self._scale(size, float(drain_timeout_s))
            except (ControlCallError, EngineDeadError) as exc:
                failure.append(exc)
            finally:
                self.target = None
                self._notify()
                done.set()

        group.nursery.start_soon(run)
        await done.wait()
        if failure:
            raise failure[0]

    async def _scale(self, size: int, drain_timeout_s: float) -> None:
        group = self._group
        was = len(group.supervisors)
        log.info("scaling from %d to %d engine(s)", was, size)
        if group.config.data_parallel_lockstep:
            await self._reform(size, drain_timeout_s)
        elif size > was:
            await self._grow(size, drain_timeout_s)
        else:
            await self._shrink(size, drain_timeout_s)
        log.info("scaled from %d to %d engine(s)", was, size)

    # --- the steps -----------------------------------------------------------

    def _resize(self, size: int) -> None:
        """The group's size is ``size`` from now on: its config (which a new
        engine core's life is started with) and the coordinator's picture."""
        group = self._group
        group.config = group.config.replace(data_parallel_size=size)
        if isinstance(group.remote, RemoteEngines):  # on Ray: the engine indices it takes joins for
            group.remote.config = group.config
        group.coordinator.picture.resize(size)
        for supervisor in group.supervisors[:size]:
            supervisor.config = group.config
        self._notify()

    async def _grow(self, size: int, drain_timeout_s: float) -> None:
        group = self._group
        was = len(group.supervisors)
        self._resize(size)  # (before the new supervisors: their config says they are local)
        new = [group.new_supervisor(i) for i in range(was, size)]
        _like(new, _served_as(group.supervisors[0]))
        group.supervisors += new
        self._notify()
        try:
            await self._start(new)
        except ControlCallError:
            await self._shrink(was, drain_timeout_s)  # the new ones that started, drained and stopped again
            raise

    async def _shrink(self, size: int, drain_timeout_s: float) -> None:
        group = self._group
        departing = group.supervisors[size:]
        for supervisor in departing:
            supervisor.departing = True  # routing passes them by from now on
        self._notify()
        await self._drain(departing, drain_timeout_s, size)
        for supervisor in departing:
            supervisor.stop()
        for supervisor in departing:
            await supervisor.wait_stopped()
        del group.supervisors[size:]
        self._resize(size)

    async def _reform(self, size: int, drain_timeout_s: float) -> None:
        """Lockstep: every engine departs and drains, then a new generation of ``size`` starts."""
        group = self._group
        old = list(group.supervisors)
        for supervisor in old:
            supervisor.departing = True  # new requests wait for the next generation
        self._notify()
        await self._drain(old, drain_timeout_s, size)
        try:
            await self._new_generation(old, size)
        except ControlCallError as error:
            log.error("%s; starting %d engine(s) again", error, len(old))
            await self._new_generation(group.supervisors, len(old))
            raise

    async def _new_generation(self, old: list[EngineSupervisor], size: int) -> None:
        """Stop ``old`` and start ``size`` engines in a generation (a collective) of their own."""
        group = self._group
        group.generation += 1  # an old engine's death from now on is no longer the group's
        group.coordinator.reset_waves()  # the waves go on at the next number
        group.lockstep = size > 1
        served = _served_as(old[0])  # (read before they stop)
        for supervisor in old:
            supervisor.departing = True
            supervisor.stop()
        for supervisor in old:
            await supervisor.wait_stopped()
        self._resize(size)  # (before the new supervisors: their config says they are local)
        group.supervisors = [group.new_supervisor(i) for i in range(size)]
        _like(group.supervisors, served)
        self._notify()
        await self._start(group.supervisors)

    async def _start(self, new: list[EngineSupervisor]) -> None:
        """Start ``new`` at once in the group's nursery; return once all are
        ready. The first that cannot start cancels those still starting, and
        raises ``ControlCallError`` naming it."""
        nursery = self._group.nursery
        assert nursery is not None

        async def start(supervisor: EngineSupervisor) -> None:
            await nursery.start(supervisor.run)

        try:
            async with trio.open_nursery() as starting:
                for supervisor in new:
                    starting.start_soon(start, supervisor)
        except* EngineStartupError as group:
            raise ControlCallError(f"scaling to {self.target} engines: {group.exceptions[0]}") from None

    async def _drain(self, departing: list[EngineSupervisor], timeout_s: float, size: int) -> None:
        """Wait until the departing engines hold no request, at most
        ``timeout_s``; then end those left with ``EngineDeadError``."""
        with trio.move_on_after(timeout_s):
            # (A client keeps no event for "no request left": a drain looks every DRAIN_POLL_S.)
            while any(s.client is not None and s.client.requests for s in departing):  # noqa: ASYNC110
                await trio.sleep(DRAIN_POLL_S)
        for supervisor in departing:
            client = supervisor.client
            if client is None or not client.requests:
                continue
            error = EngineDeadError(
                f"{supervisor.name} was removed (the engines scaled to {size}) before the request ended: "
                f"drain_timeout_s={timeout_s:g} passed"
            )
            log.warning("%s: %d request(s) ended: %s", supervisor.name, len(client.requests), error)
            for request_id, state in list(client.requests.items()):
                client.abort(request_id)
                state.collector.fail(error)


def _served_as(model: EngineSupervisor) -> tuple[dict[str, AddLora], list[ControlCall]]:
    """What a new engine must be put in to serve as ``model`` does: the LoRA
    adapters added while serving, and the pause or sleep it is in (or that
    is kept for its next life)."""
    calls = model.wanted()
    client = model.live_client()
    if client is not None and client.state.paused:
        calls.append(Pause())
    if client is not None and client.state.sleep_level:
        calls.append(Sleep(level=1 if client.state.sleep_level == 1 else 2))
    return dict(model.loras), calls


def _like(new: list[EngineSupervisor], served: tuple[dict[str, AddLora], list[ControlCall]]) -> None:
    """Put ``new`` engines in that state before any request reaches them (``EngineSupervisor._reapply``)."""
    loras, calls = served
    for supervisor in new:
        supervisor.loras = dict(loras)
        for call in calls:
            supervisor.remember(call)
