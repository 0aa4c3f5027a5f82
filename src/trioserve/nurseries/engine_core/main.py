"""The engine-core process: scheduler, step loop, and its socket actors.

Task tree (one ``trio.run``, under ``run_child_main``'s parent watch)::

    engine_core_main
    ├── executor          worker processes, each supervised, each a framed stream
    ├── input socket      ZMQ PULL -> inbox (bounded memory channel)
    ├── output socket     outbox (bounded memory channel) -> ZMQ PUSH
    └── step loop         apply inbox -> schedule and send step N+1 -> step N-1's
                          outputs to the outbox -> wait for step N -> postprocess

The step loop never awaits a client: it only waits on its inbox (when idle),
the executor, and the outbox. Start-up: connect to the front-end's handshake
socket, send ``Hello``, receive ``HandshakeInit`` (within
``TRIOSERVE_HANDSHAKE_TIMEOUT_S``, which the front-end sets to its
``startup_timeout_s``), start the workers, reply ``Ready`` (or
``StartupFailed`` naming the stage, the process and its exit code). Given
``HandshakeInit.frontends`` (several API-server processes), it binds their
sockets first and says in ``Ready`` where (``nurseries/engine_core/api_servers.py``).

Any failure after that (a worker that exits, raises, or does not finish a
step within ``step_timeout_s``) is reported to the front-end as
``EngineDead`` with the reason, once the workers are reaped; then the
process exits 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
import zmq

from trioserve.core import waves
from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.core.waves import EngineWaves
from trioserve.errors import EngineStartupError, describe, first_leaf, meaningful_leaves, sole_leaf
from trioserve.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineResponse,
    FrontEndsInit,
    GetStats,
    HandshakeInit,
    HandshakeMessage,
    Heartbeat,
    Hello,
    LoadReport,
    Ping,
    PrefixCacheReset,
    Ready,
    ResetPrefixCache,
    StartupFailed,
    StartWave,
    TokenOutput,
    WaveNotice,
)
from trioserve.nurseries.engine_core.api_servers import ApiServers
from trioserve.nurseries.engine_core.control import Controller
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.executor.handles import ExecutorStage, WorkerError
from trioserve.nurseries.supervision.child_main import ChildExit, ChildFailed, remove_if_parent_dies
from trioserve.rpc import ControlRequest
from trioserve.transport.curve import CurveKeys, load_keys
from trioserve.transport.router import SocketLoop
from trioserve.transport.silence import Silence
from trioserve.transport.zmq_trio import TrioZmqSocket

HANDSHAKE_ADDRESS_ENV = "TRIOSERVE_HANDSHAKE_ADDRESS"
ENGINE_INDEX_ENV = "TRIOSERVE_ENGINE_INDEX"
# How long the engine core waits for the front-end's HandshakeInit: the
# front-end sets it to its startup_timeout_s.
HANDSHAKE_TIMEOUT_ENV = "TRIOSERVE_HANDSHAKE_TIMEOUT_S"
# On TCP (an engine core on another host than its front-end): the directory
# of the deployment's CURVE keys, or INSECURE_TCP_ENV=1 to go without.
CURVE_KEYS_ENV = "TRIOSERVE_CURVE_KEYS"
INSECURE_TCP_ENV = "TRIOSERVE_INSECURE_TCP"
# On TCP: a private directory of the parent's (the headless process's) for
# this life of the engine core (tensor parallelism's rendezvous file goes
# there; with one rank the engine core removes it at once); the parent
# removes it when the engine core ends, however it ends.
PRIVATE_DIR_ENV = "TRIOSERVE_PRIVATE_DIR"
API_SERVERS_DIR_ENV = "TRIOSERVE_API_SERVERS_DIR"  # where a local engine core listens for API servers
DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0  # EngineConfig.startup_timeout_s's default
INBOX_SIZE = 1024  # requests and aborts waiting for the step loop
LOAD_REPORT_INTERVAL_S = 0.02  # the most often the load goes out when it changes
OUTBOX_SIZE = 64  # output batches waiting for the output socket

log = logging.getLogger("trioserve.engine_core")
_encode = msgspec.msgpack.Encoder().encode


class EngineCore:
    """The step loop: a scheduler fed from an inbox, its steps run by the
    executor, the outputs sent to an outbox. It owns ``in_flight``, the one
    queue of steps sent to the workers and not yet postprocessed."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        info: EngineInfo,
        in_flight: deque[Step] | None = None,
        waves: EngineWaves | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.info = info
        self.in_flight: deque[Step] = deque() if in_flight is None else in_flight
        # Lockstep (core/waves.py): step while the wave runs, one step at a time, since
        # whether the next one is due depends on the last one's collective.
        self.waves = waves
        self.depth = 1 if waves is not None else executor.config.max_steps_in_flight
        self._unsent: list[TokenOutput] = []  # outputs of the last step postprocessed, not yet in the outbox
        self._replies: list[EngineResponse] = []  # answers to front-end messages, not yet in the outbox
        self.control = Controller(scheduler, executor, self._replies)  # pause, sleep, calls to the workers
        self._last_load = LoadReport(num_waiting=0, num_running=0)
        self._last_load_at = -math.inf

    async def step_loop(
        self, inbox: trio.MemoryReceiveChannel[EngineRequest], outbox: trio.MemorySendChannel[EngineResponse]
    ) -> None:
        """Run steps while there is work; sleep on the inbox when there is none.

        Each turn: take what the front-end sent; plan and send the next step
        (up to ``max_steps_in_flight`` are with the workers at once, so they
        go from one step straight to the next); send the last step's outputs
        to the front-end, once the step after it is on its way; then wait
        for the oldest step and postprocess it. A control call that can run
        (``nurseries/engine_core/control.py``) runs first, once the steps in flight are
        collected. If cancelled, steps still in flight are dropped with the
        workers.
        """
        while True:
            await self._wait_for_work(inbox, outbox)
            self._take_messages(inbox)
            if self.control.has_ready():
                while self.in_flight:
                    await self._collect_oldest()
                await self.control.run_ready(self._admit)
            sent = await self._plan_and_send()
            await self._send_outputs(outbox)
            if self.in_flight and (len(self.in_flight) == self.depth or not sent):
                await self._collect_oldest()
            elif not self.in_flight:
                await trio.lowlevel.checkpoint()

    async def _wait_for_work(
        self, inbox: trio.MemoryReceiveChannel[EngineRequest], outbox: trio.MemorySendChannel[EngineResponse]
    ) -> None:
        """When nothing is in flight, unfinished or ready to run (and, in
        lockstep, no wave runs), flush the outputs and sleep on the inbox."""
        if not self.in_flight and not self._due() and not self.control.has_ready():
            await self._send_outputs(outbox)
            self.apply(await inbox.receive())

    def _due(self) -> bool:
        """Is a step due? When there is work, and in lockstep while the wave runs."""
        has_work = self.scheduler.has_unfinished()
        return has_work if self.waves is None else self.waves.should_step(has_work)

    def _take_messages(self, inbox: trio.MemoryReceiveChannel[EngineRequest]) -> None:
        while True:
            try:
                self.apply(inbox.receive_nowait())
            except trio.WouldBlock:
                return

    async def _plan_and_send(self) -> bool:
        """Plan the next step and send it to the workers, if there is room in
        flight and work to do. True when a step was sent."""
        if len(self.in_flight) >= self.depth or not self._due():
            return False
        step = self.scheduler.schedule(always=self.waves is not None)
        if step is not None and self.waves is not None:
            step.scheduled.dp_unfinished = self.scheduler.has_unfinished()
        if step is None:
            return False
        await self.executor.dispatch(step)
        self.in_flight.append(step)
        return True

    async def _collect_oldest(self) -> None:
        step = self.in_flight[0]
        runner_output = await self.executor.collect(step)
        self.in_flight.popleft()
        self._unsent += self.scheduler.postprocess(step, runner_output)
        if self.waves is not None:
            done = self.waves.stepped(bool(runner_output.dp_any_unfinished))
            if done is not None:
                self._replies.append(WaveNotice(kind="complete", wave=done.wave, engine=self.waves.engine))

    async def _send_outputs(self, outbox: trio.MemorySendChannel[EngineResponse]) -> None:
        """Tokens first, then replies: a request that ended before a pause
        had its last token sent before the pause is answered."""
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            await outbox.send(EngineOutputs(outputs=outputs))
        while self._replies:  # the list is shared with the controller: empty it in place
            await outbox.send(self._replies.pop(0))
        if (report := self._load_changed()) is not None:
            await outbox.send(report)

    def load(self) -> LoadReport:
        num_waiting = self.scheduler.num_waiting + self.control.num_held
        return LoadReport(num_waiting=num_waiting, num_running=self.scheduler.num_running)

    def _load_changed(self) -> LoadReport | None:
        """The load, when it changed since the last report and the last
        report is at least ``LOAD_REPORT_INTERVAL_S`` old (the heartbeats
        carry it too, so a change held back here goes out with the next)."""
        now = trio.current_time()
        load = self.load()
        if load == self._last_load or now < self._last_load_at + LOAD_REPORT_INTERVAL_S:
            return None
        self._last_load, self._last_load_at = load, now
        return load

    def apply(self, msg: EngineRequest) -> None:
        """Apply one front-end message; its reply, if any, goes out with the next outputs."""
        if isinstance(msg, AddRequest):
            if self.control.admitting:
                self._admit(msg)
            else:
                self.control.hold(msg)
        elif isinstance(msg, StartWave):
            if self.waves is not None:
                self.waves.start_wave(waves.StartWave(msg.wave, msg.exclude))
        elif isinstance(msg, AbortRequests):
            self.control.drop_held(msg.request_ids)
            self.scheduler.abort(msg.request_ids)
        elif isinstance(msg, ResetPrefixCache):
            num_blocks = self.scheduler.reset_prefix_cache()
            self._replies.append(PrefixCacheReset(call_id=msg.call_id, num_blocks=num_blocks))
        elif isinstance(msg, GetStats | ControlRequest):
            self.control.submit(msg)

    def _admit(self, msg: AddRequest) -> None:
        """Give a request to the scheduler; in lockstep, its wave stamp may
        ask the other engines to start a wave."""
        self._add(msg)
        if self.waves is not None and (notice := self.waves.add_request(msg.wave)) is not None:
            self._replies.append(WaveNotice(kind="start_requested", wave=notice.wave, engine=notice.engine))

    def _add(self, msg: AddRequest) -> None:
        try:
            request = Request(msg.request_id, msg.prompt_token_ids, msg.params, self.info.eos_token_ids, msg.client_id)
            self.scheduler.add(request)
        except ValueError as exc:
            # The front-end validates first; this guards against any other sender.
            error = TokenOutput(msg.request_id, [], finish_reason="error", error=str(exc))
            self._replies.append(EngineOutputs(outputs=[error]))


async def input_socket_actor(
    address: str,
    inbox: trio.MemorySendChannel[EngineRequest],
    heard: Callable[[], None] | None = None,
    bind: bool = False,
    note: Callable[[EngineRequest], None] | None = None,
    left: Callable[[], None] | None = None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the input socket (connected to ``address``, or bound there with
    ``bind``; reports the endpoint, the port the kernel picked included):
    decode each message and pass it to the step loop (``heard`` is told of
    every message, ``note`` is shown each one passed on; a ``Ping`` goes no
    further, and ``left`` is told of one saying the front-end is leaving). Closes a clone of ``inbox``, not ``inbox``.

    A message that does not decode is logged and dropped: bad input never
    kills the engine. If cancelled, the socket is closed; nothing is half-read.
    """
    decoder = msgspec.msgpack.Decoder(EngineRequest)
    attach = TrioZmqSocket.bind if bind else TrioZmqSocket.connect
    with attach(zmq.PULL, address, linger=0, **socket_options(address, bind=bind)) as sock:
        task_status.started(endpoint(sock))
        async with inbox.clone() as mine:
            while True:
                raw = await sock.recv()
                if heard is not None:
                    heard()
                try:
                    msg = decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    log.warning("dropping a malformed message from the front-end: %s", exc)
                    continue
                if isinstance(msg, Ping):
                    if msg.leaving and left is not None:
                        left()
                    continue
                if note is not None:
                    note(msg)
                await mine.send(msg)


def socket_options(address: str, *, bind: bool = False) -> dict[str, object]:
    """Options for a socket at ``address``: on TCP, CURVE with the keys in
    ``$TRIOSERVE_CURVE_KEYS`` (a client connecting to the front-end, or with
    ``bind`` a server for the API servers: the process then needs a ZAP
    handler, ``curve_keys``), or nothing with ``$TRIOSERVE_INSECURE_TCP=1``;
    ``EngineStartupError`` with neither."""
    if not address.startswith("tcp://"):
        return {}
    keys = curve_keys(address)
    if keys is None:
        return {}
    return keys.server_options() if bind else keys.client_options()


def curve_keys(address: str) -> CurveKeys | None:
    """The CURVE keys for TCP sockets (see ``socket_options``): None with
    ``$TRIOSERVE_INSECURE_TCP=1``."""
    keys_dir = os.environ.get(CURVE_KEYS_ENV)
    if keys_dir:
        try:
            return load_keys(keys_dir)
        except ValueError as exc:
            raise EngineStartupError(str(exc), stage="handshake") from None
    if os.environ.get(INSECURE_TCP_ENV) == "1":
        return None
    raise EngineStartupError(
        f"{address} is TCP: set {CURVE_KEYS_ENV} to the CURVE keys' directory (or {INSECURE_TCP_ENV}=1)",
        stage="handshake",
    )


def endpoint(sock: TrioZmqSocket) -> str:
    """The endpoint ``sock`` was last bound or connected to (``tcp://host:port``
    with the port the kernel picked)."""
    last = sock.socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return last.decode()


# The exit code of a headless engine core whose front-end said it is stopping
# (EX_TEMPFAIL): its headless supervisor says so in one line and joins again.
HEAD_LEFT_EXIT = 75


class FrontEndWatch:
    """On TCP there is no parent pipe: the front-end sends a ``Ping`` every
    ``heartbeat_interval_s``, and when nothing at all comes from it for
    ``heartbeat_timeout_s``, it is gone, and ``run`` raises: the engine core
    stops its workers and exits (its headless supervisor reconnects). A
    front-end that stops says so (``Ping(leaving=True)``): then at once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._silence = Silence()  # time this process did not run is excused (transport/silence.py)
        self._scope = trio.CancelScope()
        self._left = False

    def heard(self) -> None:
        self._silence.heard()

    def left(self) -> None:
        """The front-end said it is stopping (``Ping(leaving=True)``)."""
        self._left = True
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            await self._silence.wait(self.timeout_s)
        if self._left:
            raise ChildExit(HEAD_LEFT_EXIT, "the front-end said it is stopping: this engine core goes, to join again")
        raise ChildFailed(f"the front-end sent nothing for {self.timeout_s}s (heartbeat_timeout_s): it is gone")


async def output_socket_actor(
    address: str,
    outbox: trio.MemoryReceiveChannel[EngineResponse],
    death: DeathReport | None = None,
    api_servers: ApiServers | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the output socket: send every message from the outbox, in order
    (with several API servers, each gets its share first: ``ApiServers.route``);
    a death report that found the outbox full goes right after the message
    being sent."""
    with TrioZmqSocket.connect(zmq.PUSH, address, linger=1000, **socket_options(address)) as sock:
        task_status.started()
        async for msg in outbox:
            for one in (msg, death.take_unsent() if death is not None else None):
                routed = one if api_servers is None or one is None else api_servers.route(one)
                if routed is not None:
                    await sock.send(_encode(routed))


async def _handshake(sock: TrioZmqSocket, engine_index: int) -> HandshakeInit:
    await sock.send(_encode(Hello(engine_index=engine_index, pid=os.getpid())))
    msg = msgspec.msgpack.decode(await sock.recv(), type=HandshakeMessage)
    _check_not_leaving(msg)
    if not isinstance(msg, HandshakeInit):
        raise EngineStartupError(f"expected HandshakeInit, got {type(msg).__name__}", stage="handshake")
    return msg


def _check_not_leaving(msg: HandshakeMessage) -> None:
    """``ChildExit(HEAD_LEFT_EXIT)`` when ``msg`` says that a head on another
    host stops while this engine core joins it."""
    if isinstance(msg, Ping) and msg.leaving:
        raise ChildExit(HEAD_LEFT_EXIT, "the front-end said it is stopping while this engine core joined it")


def _hear_leaving(frames: list[bytes]) -> None:
    """A message on the handshake socket while the workers load: only a head
    that stops says anything there."""
    try:
        msg = msgspec.msgpack.decode(frames[0], type=HandshakeMessage)
    except msgspec.DecodeError:
        log.warning("dropping a malformed message on the handshake socket")
        return
    _check_not_leaving(msg)


def handshake_timeout_s() -> float:
    """``TRIOSERVE_HANDSHAKE_TIMEOUT_S`` from the environment; the default
    (with a warning) when it is missing or not a positive number."""
    raw = os.environ.get(HANDSHAKE_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_HANDSHAKE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        log.warning(
            "%s=%r is not a positive number of seconds: using %ss",
            HANDSHAKE_TIMEOUT_ENV,
            raw,
            DEFAULT_HANDSHAKE_TIMEOUT_S,
        )
        return DEFAULT_HANDSHAKE_TIMEOUT_S
    return value


def _startup_failure(exc: BaseException, stage: ExecutorStage) -> StartupFailed:
    """``StartupFailed`` for a start-up that raised ``exc``, while the
    executor was at ``stage``: the stage, process and exit code come from
    the first error that names its process (``WorkerError``, ``EngineStartupError``)."""
    named = next(
        (
            leaf
            for leaf in meaningful_leaves(exc)
            if isinstance(leaf, (WorkerError, EngineStartupError)) and leaf.process
        ),
        None,
    )
    failed_stage = named.stage if named is not None else stage
    return StartupFailed(
        stage="kv-cache" if failed_stage == "step" else failed_stage,
        message=describe(exc),
        process=named.process if named is not None else "",
        exit_code=named.exit_code if named is not None else None,
    )


class DeathReport:
    """``EngineDead``, sent once, the moment the engine core knows it is
    failing: before its workers are stopped and reaped, so that clients hear
    at once. ``report`` is synchronous (the executor calls it where it finds
    the failure); the message goes through the outbox, after the outputs
    already there, or, when the outbox is full, straight after the message
    the output socket actor is sending."""

    def __init__(self, outbox: trio.MemorySendChannel[EngineResponse]) -> None:
        self._outbox = outbox
        self.reason: str | None = None
        self._unsent: EngineDead | None = None

    def report(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason  # the process's one exit line says it (ChildFailed)
        try:
            self._outbox.send_nowait(EngineDead(reason=reason))
        except trio.WouldBlock:
            self._unsent = EngineDead(reason=reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the output socket is gone: nobody to tell

    def take_unsent(self) -> EngineDead | None:
        unsent, self._unsent = self._unsent, None
        return unsent


def ipc_directory(address: str) -> str | None:
    """The directory of an ``ipc://`` address (None for TCP)."""
    return os.path.dirname(address.removeprefix("ipc://")) if address.startswith("ipc://") else None


async def engine_core_main() -> None:
    engine_index = int(os.environ.get(ENGINE_INDEX_ENV, "0"))
    handshake_address = os.environ[HANDSHAKE_ADDRESS_ENV]
    if (front_end_dir := ipc_directory(handshake_address)) is not None:
        # The front-end's private directory: if the front-end dies (kill -9), nobody else removes it.
        remove_if_parent_dies(front_end_dir)
    if PRIVATE_DIR_ENV in os.environ:  # the headless process's, likewise
        remove_if_parent_dies(os.environ[PRIVATE_DIR_ENV])
    if API_SERVERS_DIR_ENV in os.environ:
        # The API servers' directory, the supervising process's: after its kill -9 before any API server
        # runs (the engines start first), nobody else removes it. Taken before the handshake, which a
        # kill -9 may come before.
        remove_if_parent_dies(os.environ[API_SERVERS_DIR_ENV])
    handshake = TrioZmqSocket.connect(zmq.DEALER, handshake_address, linger=1000, **socket_options(handshake_address))
    with handshake:
        timeout = handshake_timeout_s()
        with trio.move_on_after(timeout) as scope:
            init = await _handshake(handshake, engine_index)
        if scope.cancelled_caught:  # nobody to tell: one line on stderr (found: a traceback)
            raise ChildFailed(
                f"engine-core-{engine_index} (pid {os.getpid()}) got no HandshakeInit from the front-end "
                f"within {timeout}s ({HANDSHAKE_TIMEOUT_ENV})"
            )
        if PRIVATE_DIR_ENV in os.environ and init.config.tensor_parallel_size == 1:
            # Nothing goes there (no ranks to meet): gone now, a kill -9 of the whole tree cannot leave it.
            with contextlib.suppress(OSError):
                os.rmdir(os.environ.pop(PRIVATE_DIR_ENV))
        outbox_send, outbox_receive = trio.open_memory_channel[EngineResponse](OUTBOX_SIZE)
        death = DeathReport(outbox_send)
        api_servers = ApiServers(engine_index) if init.frontends is not None else None
        # A front-end on another host did not stop this engine core itself: it must hear of a stop here
        # (the headless process's, a SIGTERM) at once, not find it silent a heartbeat timeout later. So
        # there the output socket outlives a stop too, until the report is sent.
        remote = init.output_address.startswith("tcp://")
        output_shield = trio.CancelScope(shield=remote)
        async with trio.open_nursery() as outer:
            # The output socket outlives the rest, so that a failure can be reported.
            await outer.start(
                _within, output_shield, output_socket_actor, init.output_address, outbox_receive, death, api_servers
            )
            try:
                await _serve(init, handshake, outbox_send, death, (outer, api_servers))
            except BaseException as exc:  # a failure can come beside a stop's Cancelled (a BaseExceptionGroup)
                if sole_leaf(exc, ChildExit) is not None:
                    raise  # the front-end left: nobody to report to
                if not any(isinstance(leaf, Exception) for leaf in meaningful_leaves(exc)):
                    if remote:  # a stop
                        death.report(f"engine-core-{engine_index} (pid {os.getpid()}) was stopped on its host")
                        await _flush(outbox_send)
                    raise  # a stop, or KeyboardInterrupt and the like: not a failure to report
                death.report(describe(exc))
                await _flush(outbox_send)
                raise ChildFailed(death.reason or "failed") from exc
            finally:
                output_shield.cancel()
                outer.cancel_scope.cancel()


async def _within(
    scope: trio.CancelScope, actor: Callable[..., Awaitable[None]], *args: Any, task_status: trio.TaskStatus[None]
) -> None:
    """Run ``actor(*args)`` (started as by ``nursery.start``) inside ``scope``."""
    with scope:
        await actor(*args, task_status=task_status)


async def _flush(outbox: trio.MemorySendChannel[EngineResponse]) -> None:
    """Give the output socket a moment (at most half a second, even while
    cancelled) to send what the outbox holds and hand it to ZMQ."""
    with trio.CancelScope(shield=True):
        for _ in range(45):  # polled: nothing tells when a channel's buffer empties
            if not outbox.statistics().current_buffer_used:
                break
            await trio.sleep(0.01)
        await trio.sleep(0.05)


async def _serve(
    init: HandshakeInit,
    handshake: TrioZmqSocket,
    outbox: trio.MemorySendChannel[EngineResponse],
    death: DeathReport,
    api_servers: tuple[trio.Nursery, ApiServers | None] | None = None,
) -> None:
    """Serve ``init``; the API servers' sockets (if any) run in the nursery
    given with them, so that a death report still reaches them."""
    config = init.config
    if init.data_parallel is not None:
        # The lockstep rendezvous directory is the front-end's, as above.
        remove_if_parent_dies(os.path.dirname(init.data_parallel.rendezvous))
    async with trio.open_nursery() as nursery:
        in_flight: deque[Step] = deque()
        address = os.environ[HANDSHAKE_ADDRESS_ENV]
        private_dir = ipc_directory(address) or os.environ.get(PRIVATE_DIR_ENV)
        executor = Executor(
            config,
            in_flight,
            on_failure=death.report,
            data_parallel=init.data_parallel,
            engine_index=int(os.environ.get(ENGINE_INDEX_ENV, "0")),
            private_dir=private_dir,
        )
        info = await _start_executor(nursery, executor, handshake, address.startswith("tcp://"))
        scheduler = Scheduler(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        inbox_send, inbox_receive = trio.open_memory_channel[EngineRequest](INBOX_SIZE)
        watch = FrontEndWatch(config.heartbeat_timeout_s) if address.startswith("tcp://") else None
        if watch is not None:
            nursery.start_soon(watch.run)
        # The supervising process of several API servers aborts a dead one's requests, which its note names.
        note = None if api_servers is None or api_servers[1] is None else api_servers[1].note
        heard, left = (None, None) if watch is None else (watch.heard, watch.left)
        await nursery.start(input_socket_actor, init.input_address, inbox_send, heard, False, note, left)
        bound = None  # where the API servers connect
        if api_servers is not None and api_servers[1] is not None and init.frontends is not None:
            start = functools.partial(api_servers[1].run, init.frontends, info, inbox_send)
            bound = await _listen_for_api_servers(api_servers[0], start, handshake)
        await handshake.send(_encode(Ready(info=info, frontends=bound)))
        lockstep = None if init.data_parallel is None else EngineWaves(init.data_parallel.rank)
        core = EngineCore(scheduler, executor, info, in_flight, lockstep)
        nursery.start_soon(_heartbeats, outbox.send, executor, core)
        await core.step_loop(inbox_receive, outbox)


async def _listen_for_api_servers(
    nursery: trio.Nursery, run: Callable[..., Awaitable[None]], handshake: TrioZmqSocket
) -> FrontEndsInit:
    """Start the API servers' sockets (``ApiServers.run``) in ``nursery``;
    where they listen. A failure to bind (a port in use, an address not this
    host's, no route to the head) is told to the front-end as
    ``StartupFailed`` and raised (``EngineStartupError``)."""
    try:
        bound: FrontEndsInit = await nursery.start(run)
        return bound
    except* (OSError, zmq.ZMQError) as group:
        message = f"cannot listen for the API servers: {group.exceptions[0]}"
        process = f"engine-core-{os.environ.get(ENGINE_INDEX_ENV, '0')}"
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await handshake.send(_encode(StartupFailed(stage="handshake", message=message, process=process)))
        raise EngineStartupError(message, stage="handshake", process=process) from None


async def _start_executor(
    nursery: trio.Nursery, executor: Executor, handshake: TrioZmqSocket, remote: bool
) -> EngineInfo:
    """Start the workers, with heartbeats on the handshake socket while they
    load; on a failure, tell the front-end ``StartupFailed`` and raise. With
    a ``remote`` front-end (another host), also listen there meanwhile: a
    head that stops says so (``ChildExit(HEAD_LEFT_EXIT)``, the workers
    stopped first)."""
    loop = SocketLoop(_hear_leaving) if remote else None  # one task owns the socket: it sends and receives

    async def send(msg: Heartbeat) -> None:
        if loop is None:
            await handshake.send(_encode(msg))
        else:
            loop.send_nowait([_encode(msg)])
            await trio.lowlevel.checkpoint()

    try:
        async with trio.open_nursery() as beats:
            if loop is not None:
                beats.start_soon(loop.run, handshake)
            beats.start_soon(_heartbeats, send, executor)
            try:
                info: EngineInfo = await nursery.start(executor.run)
            finally:
                beats.cancel_scope.cancel()
    except BaseException as exc:
        if first_leaf(exc, ChildExit) is not None:
            raise  # the head left: nobody to tell
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await handshake.send(_encode(_startup_failure(exc, executor.stage)))
        raise
    return info


async def _heartbeats(
    send: Callable[[Heartbeat], Awaitable[None]], executor: Executor, core: EngineCore | None = None
) -> None:
    """Send a ``Heartbeat`` every ``heartbeat_interval_s``, saying whether a
    hang is suspected, and once requests are served (``core``), the load and
    whether generation is paused or asleep. Cancelling it leaves nothing
    half-sent."""
    while True:
        if core is None:
            await send(Heartbeat(stalled=executor.suspicion()))
        else:
            await send(Heartbeat(stalled=executor.suspicion(), load=core.load(), state=core.control.state))
        await trio.sleep(executor.config.heartbeat_interval_s)
