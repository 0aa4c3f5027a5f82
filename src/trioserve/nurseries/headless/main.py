"""``trioserve serve --headless``: engine cores for a head on another host.

Task tree (one ``trio.run``)::

    run_headless
    └── keep_engine × K          engine core of rank R + i, started again each time it ends
        └── engine-core process  leads its own process group; its workers join it; a private
                                 directory of this process's for each life (the workers' rendezvous)

Before each life of an engine core, this process asks the head's
handshake socket (``tcp://data_parallel_address:data_parallel_rpc_port``,
CURVE unless ``insecure_tcp``) whether it may join (``MayJoin``, naming its
previous engine core of that rank: the head lets the new one take its place).
Until the head says yes, no engine core starts: when no answer comes within
the handshake timeout, one line says so (nothing accepted the connection; or
it did, but not the handshake: on CURVE, the head may hold other keys) and it
asks again after ``backoff_s``; when the head refuses (the rank is another
live engine core's, or not one it takes from other hosts), one line says why
and it asks again every ``backoff_s``, quietly while the answer stays the
same. Without ``reconnect`` either ends the headless process
(``EngineStartupError``). Then the engine core connects to that socket,
takes its configuration from the head's ``HandshakeInit``, starts its
workers and serves. When the head runs several API-server
processes, the engine core also listens for them, on TCP
(``nurseries/engine_core/api_servers.py``): on ``api_address`` (by default this host's
address on the route to the head) and, with ``api_port`` P, engine core i
of this host (rank R + i) on ports P + 2i and P + 2i + 1 (by default ports
the kernel picks). It ends when the head does not answer its
``Hello`` within the handshake timeout, when the head has sent nothing (not
even a ``Ping``) for ``heartbeat_timeout_s``, or when it fails; each time, its
workers are stopped with it (and its process group is killed). With
``reconnect`` (the default) it is started again after ``backoff_s``, and so
rejoins a head that comes back; without, the headless process exits
(``EngineDeadError``), having stopped its other engine cores.

``kill -9`` of this process: its engine cores see their parent-watch pipes
end and go, workers first, within a second (``child_main.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import msgspec
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from trioserve.errors import EngineDeadError, EngineStartupError
from trioserve.messages import JoinAnswer, MayJoin
from trioserve.nurseries.engine_core.launch import HEAD_LEFT_EXIT, EngineCoreLaunch
from trioserve.nurseries.supervision.process import ProcessExited, python_argv, supervise_process
from trioserve.transport.curve import CurveKeys, load_keys
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir, zmq_context

log = logging.getLogger("trioserve.headless")


@dataclass(frozen=True, kw_only=True)
class HeadlessConfig:
    """What ``serve --headless`` needs: which ranks, where the head is, the keys."""

    start_rank: int
    num_engines: int
    address: str  # the head's data_parallel_address
    rpc_port: int
    curve_keys_dir: str | None = None
    curve_keys: CurveKeys | None = None  # the pair itself, held in memory (a Ray actor's); wins over the directory
    insecure_tcp: bool = False
    reconnect: bool = True
    handshake_timeout_s: float = 30.0
    api_address: str | None = None  # where the head's API servers reach this host (None: the route's)
    api_port: int = 0  # the first of 2 * num_engines ports for the API servers (0: the kernel picks)
    backoff_s: float = 1.0
    shutdown_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.start_rank < 0:
            raise ValueError("data_parallel_start_rank: must be >= 0")
        if self.num_engines < 1:
            raise ValueError("data_parallel_size_local: a headless host runs at least one engine core")
        if not 0 < self.rpc_port < 65536:
            raise ValueError("data_parallel_rpc_port: must be a TCP port")
        if self.curve_keys_dir is None and self.curve_keys is None and not self.insecure_tcp:
            raise ValueError("curve_keys_dir: engine cores join the head over TCP: give CURVE keys, or insecure_tcp")
        if self.api_address is not None and self.api_address in ("", "0.0.0.0", "::", "*"):
            raise ValueError("headless_address: give an address of this host that the head can reach, not a wildcard")
        if self.api_port and not 0 < self.api_port <= 65536 - 2 * self.num_engines:
            raise ValueError(f"headless_port: {2 * self.num_engines} TCP ports from there must fit below 65536")
        if self.curve_keys_dir is not None:
            load_keys(self.curve_keys_dir)  # its permissions and contents, before anything starts

    @property
    def handshake_address(self) -> str:
        return f"tcp://{self.address}:{self.rpc_port}"

    @property
    def ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.num_engines)


async def run_headless(
    config: HeadlessConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the engine cores of ``config.ranks`` until cancelled (then each is
    stopped with its workers, and reaped), or, without ``reconnect``, until
    one ends (``EngineDeadError``)."""
    async with trio.open_nursery() as nursery:
        for rank in config.ranks:
            nursery.start_soon(keep_engine, config, rank)
        task_status.started()


def engine_launch(config: HeadlessConfig, rank: int) -> EngineCoreLaunch:
    """The launch of engine core ``rank``, the ``rank - start_rank``-th of this host."""
    return EngineCoreLaunch(
        handshake_address=config.handshake_address,
        engine_index=rank,
        handshake_timeout_s=config.handshake_timeout_s,
        api_servers_host=config.api_address,
        api_servers_port=config.api_port + 2 * (rank - config.start_rank) if config.api_port else 0,
        curve_keys_dir=config.curve_keys_dir,
        curve_key_pair=config.curve_keys,
        insecure_tcp=config.curve_keys_dir is None and config.curve_keys is None and config.insecure_tcp,
        engines_on_host=config.num_engines,  # their workers share this host's cores
        local_index=rank - config.start_rank,  # and its accelerators: the i-th engine core the i-th share
    )


async def keep_engine(config: HeadlessConfig, rank: int) -> None:
    """Engine core ``rank``, started again each time it ends (see the module docstring)."""
    launch = engine_launch(config, rank)
    argv = python_argv("trioserve.nurseries.supervision.entry", "engine-core")
    previous_pid = 0  # this rank's last engine core (0: none yet)
    while True:
        await wait_until_welcome(config, rank, previous_pid)
        try:
            # A private directory for each life, removed here however the engine core ends (kill -9 too).
            with private_ipc_dir() as directory:
                await supervise_process(
                    argv,
                    name=f"engine-core-{rank}",
                    env=dataclasses.replace(launch, private_dir=str(directory)).env(os.environ),
                    grace_s=config.shutdown_grace_s,
                    new_process_group=True,
                    usual_exit_codes=frozenset({HEAD_LEFT_EXIT}),
                )
        except ProcessExited as exc:
            previous_pid = exc.pid
            head_left = exc.exit_code == HEAD_LEFT_EXIT
            why = f"engine-core-{rank}: the head stopped" if head_left else str(exc)
            if not config.reconnect:
                raise EngineDeadError(f"{why}; not reconnecting (--no-headless-reconnect)") from None
            log.warning("%s: joining %s again in %.1fs", why, config.handshake_address, config.backoff_s)
        except OSError as exc:  # it could not start (fork: EAGAIN, the process table full): try again
            why = f"engine-core-{rank}: could not start: {exc}"
            if not config.reconnect:
                raise EngineDeadError(f"{why}; not reconnecting (--no-headless-reconnect)") from None
            log.warning("%s; again in %.1fs", why, config.backoff_s)
        await trio.sleep(config.backoff_s)


async def wait_until_welcome(config: HeadlessConfig, rank: int, previous_pid: int) -> None:
    """Ask the head whether engine core ``rank`` may join (``ask_head``),
    again every ``backoff_s``, until it says yes; one warning per attempt
    that got no answer, one per new refusal (see the module docstring).
    Without ``reconnect``, the first attempt that is no yes raises
    ``EngineStartupError`` saying why. If cancelled, nothing is left open."""
    last_refusal = ""
    while True:
        answer = await ask_head(config, rank, previous_pid)
        if isinstance(answer, JoinAnswer) and not answer.refused:
            return
        if isinstance(answer, JoinAnswer):
            why = f"engine-core-{rank}: the head at {config.handshake_address} refused it: {answer.refused}"
        else:
            why = f"engine-core-{rank}: {answer}"
        if not config.reconnect:
            raise EngineStartupError(f"{why}; not reconnecting (--no-headless-reconnect)", stage="handshake")
        if not isinstance(answer, JoinAnswer):
            log.warning("%s: retrying in %.1fs", why, config.backoff_s)
        elif answer.refused != last_refusal:
            log.warning("%s; asking again every %.1fs", why, config.backoff_s)
        last_refusal = answer.refused if isinstance(answer, JoinAnswer) else ""
        await trio.sleep(config.backoff_s)


_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


async def ask_head(config: HeadlessConfig, rank: int, previous_pid: int) -> JoinAnswer | str:
    """The head's ``JoinAnswer`` to ``MayJoin(rank, previous_pid)``, or, when
    none comes within ``handshake_timeout_s``, why not in words: nothing
    accepted the connection; or something did, but not the ZeroMQ handshake
    (with CURVE, which says no more to the side that connects: the head may
    hold other keys); or the connection is up but no answer came. The
    socket is closed on return, and if cancelled."""
    keys = config.curve_keys
    if keys is None and config.curve_keys_dir is not None:
        keys = load_keys(config.curve_keys_dir)
    seen: set[int] = set()

    async def watch(monitor: TrioZmqSocket) -> None:
        while True:
            seen.add(int(parse_monitor_message(await monitor.recv_multipart())["event"]))

    with TrioZmqSocket(zmq_context().socket(zmq.DEALER)) as sock:
        sock.socket.setsockopt(zmq.LINGER, 0)
        for name, value in ({} if keys is None else keys.client_options()).items():
            sock.socket.setsockopt(getattr(zmq, name.upper()), value)
        with TrioZmqSocket(sock.socket.get_monitor_socket(_MONITORED)) as monitor:  # before connecting
            monitor.socket.setsockopt(zmq.LINGER, 0)
            sock.socket.connect(config.handshake_address)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, monitor)
                with trio.move_on_after(config.handshake_timeout_s):
                    await sock.send(_encode(MayJoin(engine_index=rank, previous_pid=previous_pid)))
                    reply = await sock.recv()
                    nursery.cancel_scope.cancel()
                    try:
                        return _decode_answer(reply)
                    except msgspec.DecodeError:
                        return f"the head at {config.handshake_address} answered with no JoinAnswer: is it trioserve?"
                nursery.cancel_scope.cancel()
    none = f"no answer from the head at {config.handshake_address} within {config.handshake_timeout_s}s"
    if zmq.EVENT_CONNECTED not in seen:
        return f"{none} (nothing accepted the connection)"
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
        return f"{none}, though it accepted the connection and the handshake"
    if keys is not None:
        return (
            f"{none}: it accepted the connection but not the CURVE handshake; "
            f"it may hold other keys than {config.curve_keys_dir}"
        )
    return f"{none}: it accepted the connection but not the handshake; it may want CURVE keys (--insecure-tcp here)"


_encode = msgspec.msgpack.Encoder().encode
_decode_answer = msgspec.msgpack.Decoder(JoinAnswer).decode
