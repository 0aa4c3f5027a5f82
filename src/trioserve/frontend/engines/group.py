"""Engine cores side by side (data parallel): one supervisor each, and the
coordinator that balances new requests across them.

Task tree (inside the caller's ``trio.run``)::

    EngineGroup.run
    ├── Resumptions.run              the requests of an engine core that died, resumed (resume.py)
    ├── Coordinator.run              load reports -> LoadPicture
    ├── EngineSupervisor.run × N     each keeps its own engine core running
    └── a scale, while one runs      (frontend/engines/scaling.py) starts or stops supervisors

Start-up starts the N engines at once and waits for all of them, each with
its own deadlines; the first that fails cancels the others, and its
``EngineStartupError`` (naming ``engine-core-<i>``, the stage and the
process) is raised. After that each engine is supervised on its own: one
that dies is restarted within its own budget, its requests in flight are
resumed on the ready engines (or end), and the others never notice. A new request goes to the ready engine
with the least load (``frontend/engines/coordinator.py``); while none is ready it
waits at most ``restart_wait_s``.

With ``data_parallel_backend="ray"`` the group first connects to the Ray
cluster (``ray_backend.py``) and makes the hub every engine core joins;
each engine's client then places its engine core through Ray, one
placement group and actor per life.

The number of engines changes while the group serves (``scaling``,
``frontend/engines/scaling.py``): routing passes a departing engine by, and
takes a new one once it is ready.

Health: ``ready`` while at least one engine is ready; otherwise ``stalled``,
``paused``, ``sleeping``, ``restarting``, ``starting`` (the best any engine
is), or ``failed`` once every engine has failed for good; ``stopped`` after
shutdown.

Several API-server processes (``serve --api-server-count M``): in the
supervising process (``api_servers_dir``), each engine core also listens for
them (a local one on ``ipc://`` there, a remote one on TCP on its host), and
``engine-<i>.addr`` there says where while it is ready; in each API server
(``attach``), the clients attach to engine cores that the supervising
process runs or takes the joins of (``frontend/engines/attached.py``), and no
handshake socket is bound.

Lockstep (``data_parallel_lockstep``): every step of every engine joins one
collective across them (``core/waves.py``), so they run as one: the
coordinator stamps requests with request waves and starts the paused
engines; and when one engine core dies, the others may be stuck in a
collective that will never complete, so they are killed at once and every
engine restarts. Each generation of the group meets at a rendezvous of its
own in a private 0700 directory, so that a new engine never joins an old
generation's collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import trio

from trioserve.config import EngineConfig
from trioserve.core import waves
from trioserve.errors import ControlCallError, EngineDeadError, leaves, meaningful_leaves
from trioserve.frontend.engines.attached import (
    AttachedStrategy,
    api_server_addresses,
    forget_engine_addresses,
    write_engine_addresses,
    write_engine_failure,
)
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.coordinator import Coordinator
from trioserve.frontend.engines.ray_backend import RayCluster, RayStrategy
from trioserve.frontend.engines.remote import RemoteEngines, RemoteStrategy
from trioserve.frontend.engines.resume import Resumptions
from trioserve.frontend.engines.scaling import Scaling
from trioserve.frontend.engines.supervisor import ClientFactory, EngineSupervisor, Health, new_client
from trioserve.messages import BIND_TCP, DataParallelInit, EngineInfo, EngineStats, FrontEndsInit, StartWave
from trioserve.rpc import ControlCall, ControlReply
from trioserve.transport.zmq_trio import private_ipc_dir

# A group's health is the best of its engines', in this order (failed: all failed).
_BEST_FIRST: tuple[Health, ...] = (
    "ready", "stalled", "paused", "sleeping", "restarting", "starting", "stopped", "failed",
)  # fmt: skip


class EngineGroup:
    """``config.data_parallel_size`` engine cores (as it was last scaled to). Run with ``await
    nursery.start(group.run)``; it reports the first engine's ``EngineInfo``
    once every engine is ready."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        client_factory: ClientFactory = new_client,
        api_servers_dir: str | None = None,
        attach: tuple[int, str] | None = None,
    ) -> None:
        """``api_servers_dir``: the engine cores also listen for API-server
        processes (there, or on TCP for those on other hosts), and each one's
        addresses are written there while it is ready. ``attach``: this is API
        server ``attach[0]``, and the engine cores (another process's, local
        or remote) are found through ``attach[1]`` (``frontend/engines/attached.py``)."""
        self.config = config
        n = config.data_parallel_size
        self.lockstep = n > 1 and config.data_parallel_lockstep
        if self.lockstep and (api_servers_dir is not None or attach is not None):
            raise ValueError("data_parallel_lockstep: not supported with several API servers yet")
        self.on_ray = config.data_parallel_backend == "ray"
        if self.on_ray and (api_servers_dir is not None or attach is not None):
            raise ValueError("data_parallel_backend: several API servers with engines on Ray are not supported yet")
        self._api_servers_dir = api_servers_dir
        self._attach = attach
        broadcast = self._broadcast if config.data_parallel_lockstep else None  # (waves from 2 engines on)
        # Several API servers send to the engines: each one's picture counts the others' through the reports.
        shared = attach is not None
        self.coordinator = Coordinator(n, config.max_num_seqs, broadcast=broadcast, shared=shared)
        self.resumptions = Resumptions(config, self.route)
        self.generation = 0  # lockstep: bumped when the engines restart together
        self._generation_of: dict[int, int] = {}  # id(client) -> the generation it was started in
        self._rendezvous_dir = ""
        # Engines on other hosts join through the hub (frontend/engines/remote.py); an API
        # server of several attaches to them as to local ones.
        # On Ray (ray_backend.py), the hub and the cluster are made when the group runs.
        hub = config.num_remote_engines and attach is None and not self.on_ray
        self.remote = RemoteEngines(config) if hub else None
        self.ray: RayCluster | None = None
        self._local_factory = client_factory
        self.supervisors = [self.new_supervisor(i) for i in range(n)]
        self.scaling = Scaling(self)  # grows and shrinks the group while it serves (frontend/engines/scaling.py)
        self.nursery: trio.Nursery | None = None  # where the supervisors run, once running
        self._last_info: EngineInfo | None = None

    def new_supervisor(self, i: int) -> EngineSupervisor:
        """The supervisor of engine ``i`` (not started)."""
        return EngineSupervisor(
            self.config,
            i,
            client_factory=self._client_factory(i, self._local_factory),
            on_load=self.coordinator.report_nowait,
            on_new_client=self._new_client,
            on_engine_ready=self._engine_ready if self._api_servers_dir is not None else None,
            on_engine_dead=self._engine_dead,
            on_failed=self._engine_failed if self._api_servers_dir is not None else None,
            remote=self._attach is not None or (not self.on_ray and i >= self.config.num_local_engines),
            reapplies=self._attach is None,  # the engine core's own front-end does, for all of them
        )

    def _client_factory(self, engine_index: int, local: ClientFactory) -> ClientFactory:
        if self._attach is not None:
            frontend, directory = self._attach
            return lambda config, i, on_dead: EngineCoreClient(
                config, i, AttachedStrategy(config, frontend, directory), on_dead=on_dead
            )
        if self.on_ray:
            return self._ray_client
        return local if engine_index < self.config.num_local_engines else self._remote_client

    def _new_client(self, client: EngineCoreClient) -> None:
        """A new engine core's client, before it starts: its place among the
        engines, and where its requests go if it dies."""
        client.on_orphans = self.resumptions.orphaned
        if self._api_servers_dir is not None:
            if client.engine_index < self.config.num_local_engines:
                client.frontends = FrontEndsInit(*api_server_addresses(self._api_servers_dir, client.engine_index))
            else:  # on another host: it binds TCP there, and says where in its Ready
                client.frontends = FrontEndsInit(BIND_TCP, BIND_TCP)
        if self.lockstep:
            self._lockstep_client(client)

    def _engine_ready(self, client: EngineCoreClient) -> None:
        """A new engine core is ready: tell the API servers where it listens for them."""
        assert self._api_servers_dir is not None
        if client.frontends_bound is not None:
            write_engine_addresses(self._api_servers_dir, client.engine_index, client.frontends_bound)

    def _engine_dead(self, client: EngineCoreClient) -> None:
        """An engine core is known dead: the API servers wait for the next one's
        addresses (and, in lockstep, its peers go too)."""
        if self._api_servers_dir is not None:
            forget_engine_addresses(self._api_servers_dir, client.engine_index)
        if self.lockstep:
            self._lockstep_death(client)

    def _engine_failed(self, supervisor: EngineSupervisor) -> None:
        """An engine failed for good: tell the API servers (they would wait for its next life)."""
        assert self._api_servers_dir is not None and supervisor.failure is not None
        write_engine_failure(self._api_servers_dir, supervisor.engine_index, str(supervisor.failure))

    def _remote_client(
        self, config: EngineConfig, engine_index: int, on_dead: Callable[[EngineCoreClient], None]
    ) -> EngineCoreClient:
        assert self.remote is not None
        return EngineCoreClient(config, engine_index, RemoteStrategy(self.remote, engine_index), on_dead=on_dead)

    def _ray_client(
        self, config: EngineConfig, engine_index: int, on_dead: Callable[[EngineCoreClient], None]
    ) -> EngineCoreClient:
        assert self.remote is not None and self.ray is not None
        return EngineCoreClient(config, engine_index, RayStrategy(self.remote, self.ray, engine_index), on_dead=on_dead)

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every engine, report the first's ``EngineInfo``, then keep
        them running until cancelled (then every process is stopped and
        reaped) or until every engine has failed for good (then return)."""
        if self.on_ray:  # the cluster, and the hub its engine cores join (with its keys)
            async with RayCluster.open(self.config) as cluster:
                self.ray = cluster
                self.remote = RemoteEngines(self.config, keys=cluster.keys)
                await self._run(task_status)
            return
        if not self.config.data_parallel_lockstep:
            await self._run(task_status)
            return
        # The lockstep collective's rendezvous files; each engine core removes
        # the directory if this process dies without doing so.
        with private_ipc_dir("trioserve-dp-", socket_names=[f"dp-{2**32}"]) as rendezvous:  # dp-<generation>
            self._rendezvous_dir = str(rendezvous)
            await self._run(task_status)

    async def _run(self, task_status: trio.TaskStatus[EngineInfo]) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await nursery.start(self.resumptions.run)
            await nursery.start(self.coordinator.run)
            if self.remote is not None:
                await nursery.start(self.remote.run)
            for supervisor in self.supervisors:
                if supervisor.remote:
                    nursery.start_soon(supervisor.run)
            await self._start_all(nursery)
            # No local engine: the first to join. An API server of several may find every one failed
            # for good before any joined it: nothing to serve, it fails with their error.
            while all(s.info is None for s in self.supervisors):
                if self.health == "failed":
                    raise await self.wait_failed()
                await self._any_change()
            task_status.started(self.info)
            await self.wait_failed()
            nursery.cancel_scope.cancel()  # the coordinator has nothing left to do

    async def _start_all(self, nursery: trio.Nursery) -> list[EngineInfo]:
        infos: dict[int, EngineInfo] = {}

        async def start(supervisor: EngineSupervisor) -> None:
            infos[supervisor.engine_index] = await nursery.start(supervisor.run)

        async with trio.open_nursery() as starting:
            for supervisor in self.supervisors:
                if not supervisor.remote:
                    starting.start_soon(start, supervisor)
        return [infos[i] for i in sorted(infos)]

    # --- lockstep ------------------------------------------------------------

    def _lockstep_client(self, client: EngineCoreClient) -> None:
        """A new engine core: its place in the current generation's collective."""
        self._generation_of[id(client)] = self.generation
        client.on_wave = self.coordinator.wave_notice
        client.data_parallel = DataParallelInit(
            rank=client.engine_index,
            size=len(self.supervisors),
            rendezvous=f"{self._rendezvous_dir}/dp-{self.generation}",
        )

    def _lockstep_death(self, dead: EngineCoreClient) -> None:
        """An engine core of the current generation died: the others may wait
        in a collective it will never join; they go too, and all restart in
        the next generation."""
        if self._generation_of.pop(id(dead), None) != self.generation:
            return  # an older generation's, already taken care of
        self.generation += 1
        self.coordinator.reset_waves()  # the next generation's engines start paused, at the next wave
        for supervisor in self.supervisors:
            client = supervisor.live_client()
            if client is not None and client is not dead:
                client.stop_now(f"engine-core-{dead.engine_index} died, and lockstep engines restart together")

    def _broadcast(self, start: waves.StartWave) -> None:
        """Tell every engine core but ``start.exclude`` to run ``start.wave``."""
        for supervisor in self.supervisors:
            client = supervisor.live_client()
            if client is not None and supervisor.engine_index != start.exclude:
                client.start_wave(StartWave(wave=start.wave, exclude=start.exclude))

    def api_server_died(self, frontend: int, pid: int) -> None:
        """API server ``frontend`` (process ``pid``) is gone: every engine
        core aborts the requests it sent, whose outputs nobody would read."""
        for supervisor in self.supervisors:
            if (client := supervisor.live_client()) is not None:
                client.abort_frontend(frontend, pid)

    # --- state ------------------------------------------------------------

    @property
    def several_api_servers(self) -> bool:
        """The engine cores serve several API servers (this is one, or their supervising process)."""
        return self._attach is not None or self._api_servers_dir is not None

    @property
    def info(self) -> EngineInfo:
        """The first engine's ``EngineInfo`` (the model's facts are every engine's)."""
        for supervisor in self.supervisors:
            if supervisor.info is not None:
                self._last_info = supervisor.info
                return supervisor.info
        if self._last_info is not None:  # a new generation is starting (scaling in lockstep): the same model
            return self._last_info
        raise RuntimeError("no engine has started yet")

    @property
    def health(self) -> Health:
        healths = [s.health for s in self.supervisors]
        if all(h == "failed" for h in healths):
            return "failed"
        return min(healths, key=_BEST_FIRST.index)

    @property
    def engine_healths(self) -> list[Health]:
        return [s.health for s in self.supervisors]

    @property
    def num_restarts(self) -> int:
        return sum(s.num_restarts for s in self.supervisors)

    def num_requests_in_flight(self) -> int:
        """Requests on an engine core, and those waiting to be resumed on one."""
        on_engines = sum(len(s.client.requests) for s in self.supervisors if s.client is not None)
        return on_engines + self.resumptions.num_waiting

    async def wait_failed(self) -> EngineDeadError:
        """Wait until every engine has failed for good; the first one's error.
        Raises ``EngineDeadError`` once every engine has failed or stopped
        and one is stopped (it never fails). A departing engine does not count."""
        while True:
            engines = [s for s in self.supervisors if not s.departing]
            failures = [s.failure for s in engines if s.failure is not None]
            if engines and len(failures) == len(engines):
                return failures[0]
            if engines and all(s.health in ("failed", "stopped") for s in engines):
                raise EngineDeadError(f"{next(s for s in engines if s.health == 'stopped').name} is stopped")
            await self._any_change()

    async def wait_health(self, *wanted: Health) -> None:
        """Wait until the group's health is one of ``wanted``."""
        while self.health not in wanted:
            await self._any_change()

    async def _any_change(self) -> None:
        waits: list[Callable[[], Awaitable[None]]] = [s.wait_changed for s in self.supervisors]
        await _first_of([*waits, self.scaling.wait_changed])

    # --- for requests -------------------------------------------------------

    async def route(self, engine_index: int | None = None) -> tuple[EngineCoreClient, int]:
        """``ready_client`` (or, given ``engine_index``, that engine's, waiting
        for it as for any), and the request wave to stamp the request with
        (in lockstep; 0 otherwise)."""
        if engine_index is None:
            client = await self.ready_client()
        else:
            if self.lockstep:
                await self._ready_engines()  # a wave needs every engine
            client = await self.scaling.routable(engine_index).ready_client()
        wave = self.coordinator.route(client.engine_index) if self.lockstep else 0
        return client, wave

    async def ready_client(self) -> EngineCoreClient:
        """The client of the ready engine with the least load. While none is
        ready, wait at most ``restart_wait_s``; then, or if every engine
        failed or stopped, raise ``EngineDeadError``. If cancelled, nothing
        is left behind."""
        if len(self.supervisors) == 1 and not self.supervisors[0].departing:
            return await self.supervisors[0].ready_client()
        ready = await self._ready_engines()
        in_flight = [len(s.client.requests) if s.client is not None else 0 for s in self.supervisors]
        chosen = self.supervisors[self.coordinator.choose(ready, in_flight)]
        client = chosen.live_client()
        assert client is not None  # nothing ran since _ready_engines looked
        return client

    async def _ready_engines(self) -> list[int]:
        """The indexes of the engines ready now; waits (see ``ready_client``) while there are none."""
        with trio.move_on_after(self.config.restart_wait_s):
            while True:
                # A departing engine (the group shrinks: frontend/engines/scaling.py) takes no new request.
                staying = [s for s in self.supervisors if not s.departing]
                ready = [s.engine_index for s in staying if s.live_client() is not None]
                # Lockstep engines run as one: a wave needs every one of them.
                if ready and (not self.lockstep or len(ready) == len(self.supervisors)):
                    return ready
                if staying and all(s.health in ("failed", "stopped") for s in staying):
                    await staying[0].ready_client()  # raises its reason
                await self._any_change()
        raise EngineDeadError(
            f"no engine core was ready within restart_wait_s={self.config.restart_wait_s}s "
            f"(health: {', '.join(self.engine_healths)})"
        )

    async def stats(self) -> EngineStats:
        """Every engine's counters and their totals. While no engine is
        ready, waits for one like a request; an engine that is restarting
        counts as zeros."""
        if len(self.supervisors) == 1:
            return await (await self.supervisors[0].ready_client()).stats()
        await self._ready_engines()  # at least one
        engines = []
        for supervisor in self.supervisors:
            client = supervisor.live_client()
            engines.append(await client.stats() if client is not None else _ZERO)
        return _total(engines)

    async def reset_prefix_cache(self) -> int:
        """Make every engine forget its cached prefixes; how many blocks they
        forgot. While no engine is ready, waits for one like a request; an
        engine that is restarting has nothing cached."""
        if len(self.supervisors) == 1:
            return await (await self.supervisors[0].ready_client()).reset_prefix_cache()
        await self._ready_engines()
        clients = [s.live_client() for s in self.supervisors]
        return sum([await c.reset_prefix_cache() for c in clients if c is not None])

    async def control(self, call: ControlCall, timeout_s: float) -> list[ControlReply]:
        """Send ``call`` to every engine core that is up, at once; their
        replies, by engine index. While none is up, waits for one like a
        request. A call asked while an engine core is down is remembered for
        its next life (by an attached API server of several, which puts no
        life in its state, it fails for that engine core). Raises ``ControlCallError`` (naming each
        engine core, and the rank, that failed) once every reply is in."""
        await self.ready_client()
        replies: dict[int, ControlReply] = {}
        errors: list[str] = []
        restarting: list[str] = []

        async def one(supervisor: EngineSupervisor, client: EngineCoreClient) -> None:
            try:
                replies[supervisor.engine_index] = await client.control(call, timeout_s)
            except (ControlCallError, EngineDeadError) as exc:
                errors.append(str(exc))

        try:
            async with trio.open_nursery() as nursery:
                for supervisor in self.supervisors:
                    if (client := supervisor.live_client()) is not None:
                        nursery.start_soon(one, supervisor, client)
                    elif supervisor.health == "failed":
                        continue  # for good: it will never generate again
                    elif supervisor.reapplies:
                        supervisor.remember(call)
                    else:  # an API server of several: the next life is put in its state by its supervisor
                        restarting.append(
                            f"{supervisor.name} is {supervisor.health}: {type(call).__name__} did not reach it "
                            "(ask again once it is up)"
                        )
        except BaseExceptionGroup as group:
            if not meaningful_leaves(group):  # a bare Cancelled, as from every other call, not a group of it
                raise leaves(group)[0] from None
            raise
        for supervisor in self.supervisors:
            supervisor.state_changed()  # health reads the replies' state now
        if errors or restarting:
            raise ControlCallError("; ".join(errors + restarting), restarting=not errors)
        return [replies[i] for i in sorted(replies)]


_ZERO = EngineStats(num_running=0, num_waiting=0, num_free_blocks=0, num_total_blocks=0, num_preemptions=0, num_steps=0)


def _total(engines: list[EngineStats]) -> EngineStats:
    lists = ("engines", "workers", "iteration_tokens")
    fields = [f for f in EngineStats.__struct_fields__ if f not in (*lists, "prefix_caching")]
    sums = {f: sum(getattr(e, f) for e in engines) for f in fields}
    return EngineStats(
        **sums,
        # an engine restarting has none (_ZERO)
        iteration_tokens=[sum(c) for c in itertools.zip_longest(*(e.iteration_tokens for e in engines), fillvalue=0)],
        prefix_caching=any(e.prefix_caching for e in engines),
        engines=engines,
        workers=[w for e in engines for w in e.workers],
    )


async def _first_of(waits: list[Callable[[], Awaitable[None]]]) -> None:
    """Return once the first of ``waits`` returns. If cancelled, nothing is left behind."""
    async with trio.open_nursery() as nursery:

        async def one(wait: Callable[[], Awaitable[None]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(one, wait)
