"""Engine cores placed by Ray (``--data-parallel-backend ray``).

Ray is used for placement and life cycle only. The front-end connects to a
Ray cluster (``ray_address``, else ``RAY_ADDRESS``; with neither, it starts
a local one as a supervised child: ``nurseries/ray/head.py``) and, for each
life of engine core ``i``, creates a placement group of its own, one node's
worth (``STRICT_PACK``): a ``{"CPU": 1}`` bundle for the engine core and one
per tensor-parallel rank (on a cluster with GPUs one bundle
``{"CPU": 1, "GPU": TP}``, which the actor takes whole, so that Ray gives
its process, and so its workers, those devices). In it runs one
``EngineCoreActor`` (``nurseries/ray/actor.py``), given its launch as
msgpack bytes: its engine core joins this front-end exactly as an engine
core on another host does (``remote.py``: the handshake socket on TCP, CURVE
with the deployment's keys or, without ``curve_keys_dir``, a key pair made
for this front-end's life), and is supervised as a local one is: its first
start's failure fails the start, its deaths count against the restart
budget.

A life ends when the engine core is dead (its death report, its silence for
``heartbeat_timeout_s``, or its actor's end, which Ray reports at once: a
killed actor process, a lost node) or when this front-end stops; either way
its actor is killed and its placement group removed before the next life
starts in a new one. If this process is killed, Ray ends the actors of its
dead driver (and so their engine cores and workers) and removes its
placement groups; a local cluster goes with its head's supervisor.

Scaling while serving (``scaling.py``) places and ends engine cores as it
starts and stops local ones. Not on Ray yet: lockstep, several API servers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineStartupError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.remote import RemoteEngines, RemoteStrategy
from trioserve.frontend.engines.scaling import MAX_ENGINES
from trioserve.nurseries.ray.actor import EngineCoreActor, RayLaunch, encode_launch
from trioserve.nurseries.ray.head import RAY_HARD_EXIT_S, RAY_HEAD_ARGS_ENV, RAY_HEAD_DIR_ENV
from trioserve.nurseries.supervision.child_main import HARD_EXIT_ENV
from trioserve.nurseries.supervision.process import python_argv, supervise_process
from trioserve.transport.curve import CurveKeys, load_keys, write_keys
from trioserve.transport.zmq_trio import private_ipc_dir

log = logging.getLogger("trioserve.ray")
RAY_EXTRA = "the ray backend needs Ray: pip install 'trioserve[ray]'"
LOCAL_START_S = 120.0  # a local cluster's head coming up (about 10 s on 2 busy cores)
POLL_S = 0.25  # how often an actor's end is looked for
RELEASE_S = 10.0  # an actor's kill and its placement group's removal
# The longest Unix socket path a local cluster makes in its temporary directory (``ray/`` in ours): the
# directory goes where that path fits in the 107 bytes a socket path may have.
RAY_SOCKET = "ray/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"


def _resources(which: str) -> dict[str, float]:
    """Ray's ``cluster_resources()`` or ``available_resources()``."""
    import ray

    found: dict[str, float] = getattr(ray, f"{which}_resources")()
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RayCluster:
    """This front-end's connection to a Ray cluster, and what it placed there."""

    def __init__(self, config: EngineConfig, keys: CurveKeys | None) -> None:
        self.config = config
        self.keys = keys
        self.session = uuid.uuid4().hex[:8]
        self.gpus = False
        self.connected_here = False  # ray.init by this front-end (else the process already was: it stays)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: EngineConfig) -> AsyncIterator[RayCluster]:
        """Connect (starting a local cluster when no address is given); on
        exit disconnect, and stop the local cluster if one was started."""
        # ``ray start`` makes clusters that want Ray's token (~/.ray/auth_token); a driver asks for
        # it only in this mode, which Ray reads when it is imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
        if address is None and not os.environ.get("RAY_AUTH_TOKEN"):
            # A local cluster's token, made for it (in this process's environment, which its head and this
            # driver read): none needs to be on disk, where a fresh machine has none.
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        try:
            import ray
        except ImportError:
            raise EngineStartupError(RAY_EXTRA, stage="spawn") from None
        async with trio.open_nursery() as nursery:
            with private_ipc_dir("trioserve-ray-", socket_names=[RAY_SOCKET]) as private:
                if address is None:
                    address = await _start_local_head(nursery, config, private / "ray")
                keys = cls._keys(config, private)
                cluster = cls(config, keys)
                await _check_reachable(address, config.startup_timeout_s)
                # Abandoned if cancelled (a signal while Ray connects): ray.init cannot be interrupted.
                await trio.to_thread.run_sync(cluster._connect, address, abandon_on_cancel=True)
                try:
                    yield cluster
                finally:
                    if cluster.connected_here:
                        with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_S):
                            await trio.to_thread.run_sync(ray.shutdown)
                    nursery.cancel_scope.cancel()

    @staticmethod
    def _keys(config: EngineConfig, private: Path) -> CurveKeys | None:
        """The deployment's keys; without them (and without ``insecure_tcp``)
        a pair made for this life of the front-end."""
        if config.curve_keys_dir is not None:
            return load_keys(config.curve_keys_dir)
        if config.insecure_tcp:
            return None
        return write_keys(private / "keys")

    def _connect(self, address: str) -> None:
        import ray

        if not ray.is_initialized():  # (a process already connected keeps its connection and cluster)
            try:
                ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise EngineStartupError(
                    f"cannot connect to the Ray cluster at {address}: {why}", stage="spawn"
                ) from None
            self.connected_here = True
        self.gpus = _resources("cluster").get("GPU", 0) > 0
        log.info("connected to the Ray cluster at %s (%s)", address, _resources("cluster"))

    def bundles(self) -> list[dict[str, float]]:
        """One engine core's placement group: see the module docstring."""
        tp = self.config.tensor_parallel_size
        if self.gpus:
            return [{"CPU": 1, "GPU": tp}]
        return [{"CPU": 1} for _ in range(tp + 1)]

    def launch(self, engine_index: int, hub_address: str) -> bytes:
        host, _, port = hub_address.removeprefix("tcp://").rpartition(":")
        return encode_launch(
            RayLaunch(
                engine_index=engine_index,
                address=host,
                rpc_port=int(port),
                public_key=None if self.keys is None else self.keys.public,
                secret_key=None if self.keys is None else self.keys.secret,
                insecure_tcp=self.keys is None,
                handshake_timeout_s=self.config.startup_timeout_s,
                shutdown_grace_s=self.config.shutdown_grace_s,
            )
        )

    @contextlib.asynccontextmanager
    async def placed(self, client: EngineCoreClient, hub_address: str) -> AsyncIterator[None]:
        """A placement group and an actor running ``client``'s engine core for
        this life; its end (the actor's) stops the client. On exit the actor is
        killed and the group removed."""
        placement = await trio.to_thread.run_sync(self._place, client.engine_index)
        actor = done = None
        try:
            actor, done = await trio.to_thread.run_sync(
                self._start_actor, placement, client.engine_index, self.launch(client.engine_index, hub_address)
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, client, done)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_S):
                await trio.to_thread.run_sync(self._release, actor, placement)

    def _place(self, engine_index: int) -> Any:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = self.bundles()
        name = f"trioserve-{self.session}-engine-{engine_index}-{uuid.uuid4().hex[:6]}"  # one per life
        group = placement_group(bundles, strategy="STRICT_PACK", name=name)
        ready, _ = ray.wait([group.ready()], timeout=self.config.startup_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise EngineStartupError(
                f"engine-core-{engine_index}: Ray placed no {bundles} on one node within "
                f"{self.config.startup_timeout_s}s (available: {_resources('available')})",
                stage="spawn",
                process=f"engine-core-{engine_index}",
            )
        return group

    def _start_actor(self, group: Any, engine_index: int, launch: bytes) -> tuple[Any, Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources: dict[str, Any] = {"num_cpus": 1}
        if self.gpus:
            resources["num_gpus"] = self.config.tensor_parallel_size
        actor = (
            ray.remote(EngineCoreActor)
            .options(
                name=f"trioserve-{self.session}-engine-{engine_index}-actor-{uuid.uuid4().hex[:6]}",
                max_restarts=0,
                max_concurrency=2,  # run() holds one thread for the life; pid() answers beside it
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                **resources,
            )
            .remote()
        )
        return actor, actor.run.remote(launch)  # type: ignore[attr-defined]  # (Ray's actor handle)

    async def _watch(self, client: EngineCoreClient, done: Any) -> None:
        """Stop ``client`` when its actor's ``run`` ends (its engine core ended,
        or the actor died: killed, its node lost)."""
        import ray

        def finished() -> bool:
            ready, _ = ray.wait([done], timeout=POLL_S)
            return bool(ready)

        while not await trio.to_thread.run_sync(finished):
            pass
        try:
            why = str(await trio.to_thread.run_sync(ray.get, done))
        except ray.exceptions.RayError as exc:
            why = f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        client.stop_now(f"{why} (Ray)")

    @staticmethod
    def _release(actor: Any, group: Any) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(group)


class RayStrategy(RemoteStrategy):
    """An engine core placed by Ray, for one life: a remote engine core whose
    actor and placement group this life creates and ends."""

    def __init__(self, hub: RemoteEngines, cluster: RayCluster, engine_index: int) -> None:
        super().__init__(hub, engine_index)
        self.cluster = cluster

    @contextlib.asynccontextmanager
    async def life(self, client: EngineCoreClient) -> AsyncIterator[None]:
        async with super().life(client), self.cluster.placed(client, self.hub.address):
            yield


async def _start_local_head(nursery: trio.Nursery, config: EngineConfig, temp_dir: Path) -> str:
    """A local cluster's head as a supervised child (``nurseries/ray/head.py``),
    with ports of its own and logical CPUs enough for the groups of as many
    engines as a scale may ask for; its address once its GCS listens."""
    port = _free_port()
    # Logical CPUs (Ray's placement counters, not cores) for the most engines a scale may ask for.
    cpus = max(os.cpu_count() or 1, MAX_ENGINES * (config.tensor_parallel_size + 1))
    options = [
        f"--port={port}",
        f"--num-cpus={cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
    ]
    env = {**os.environ, RAY_HEAD_ARGS_ENV: "\n".join(options), RAY_HEAD_DIR_ENV: str(temp_dir.parent)}
    env[HARD_EXIT_ENV] = str(RAY_HARD_EXIT_S)  # time for ``ray start`` to shut its node down after a stop
    env.pop("RAY_ADDRESS", None)
    log.info("starting a local Ray cluster (port %d, %d logical CPUs)", port, cpus)
    await nursery.start(
        lambda task_status: supervise_process(
            python_argv("trioserve.nurseries.supervision.entry", "ray-head"),
            name="ray-head",
            env=env,
            grace_s=max(config.shutdown_grace_s, RAY_HARD_EXIT_S + 1.0),
            new_process_group=True,
            task_status=task_status,
        )
    )
    address = f"127.0.0.1:{port}"
    deadline = trio.current_time() + LOCAL_START_S
    while not await _listening(port):  # another process's port: nothing to wait on but the port
        if trio.current_time() > deadline:
            raise EngineStartupError(
                f"the local Ray cluster did not listen at {address} in {LOCAL_START_S}s", stage="spawn"
            )
        await trio.sleep(0.2)
    return address


async def _check_reachable(address: str, timeout_s: float) -> None:
    """``EngineStartupError`` at once when nothing accepts a connection at a
    ``host:port`` address (Ray's own connect retries for minutes); other
    forms (``ray://``, ``auto``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or "/" in host or not port.isdigit():
        return
    with trio.move_on_after(timeout_s):
        if await _listening(int(port), host.strip("[]")):
            return
        raise EngineStartupError(
            f"cannot connect to the Ray cluster at {address}: nothing listens there", stage="spawn"
        )
    raise EngineStartupError(f"cannot connect to the Ray cluster at {address} within {timeout_s}s", stage="spawn")


async def _listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return False
    await stream.aclose()
    return True
