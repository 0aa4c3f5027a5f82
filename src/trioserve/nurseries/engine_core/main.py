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
import dataclasses
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
from trioserve.nurseries.engine_core.launch import (
    HANDSHAKE_TIMEOUT_ENV,
    HEAD_LEFT_EXIT,
    EngineCoreLaunch,
    ipc_directory,
)
from trioserve.nurseries.engine_core.sockets import input_socket_actor, output_socket_actor
from trioserve.nurseries.supervision.child_main import ChildExit, ChildFailed, remove_if_parent_dies
from trioserve.rpc import ControlRequest
from trioserve.transport.router import SocketLoop
from trioserve.transport.silence import Silence
from trioserve.transport.zmq_trio import TrioZmqSocket

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


async def engine_core_main() -> None:
    launch = EngineCoreLaunch.from_env()
    engine_index, handshake_address = launch.engine_index, launch.handshake_address
    if (front_end_dir := ipc_directory(handshake_address)) is not None:
        # The front-end's private directory: if the front-end dies (kill -9), nobody else removes it.
        remove_if_parent_dies(front_end_dir)
    if launch.private_dir is not None:  # the headless process's, likewise
        remove_if_parent_dies(launch.private_dir)
    if launch.api_servers_dir is not None:
        # The API servers' directory, the supervising process's: after its kill -9 before any API server
        # runs (the engines start first), nobody else removes it. Taken before the handshake, which a
        # kill -9 may come before.
        remove_if_parent_dies(launch.api_servers_dir)
    options = launch.socket_options(handshake_address)
    handshake = TrioZmqSocket.connect(zmq.DEALER, handshake_address, linger=1000, **options)
    with handshake:
        timeout = launch.handshake_timeout_s
        with trio.move_on_after(timeout) as scope:
            init = await _handshake(handshake, engine_index)
        if scope.cancelled_caught:  # nobody to tell: one line on stderr (found: a traceback)
            raise ChildFailed(
                f"engine-core-{engine_index} (pid {os.getpid()}) got no HandshakeInit from the front-end "
                f"within {timeout}s ({HANDSHAKE_TIMEOUT_ENV})"
            )
        if launch.private_dir is not None and init.config.tensor_parallel_size == 1:
            # Nothing goes there (no ranks to meet): gone now, a kill -9 of the whole tree cannot leave it.
            with contextlib.suppress(OSError):
                os.rmdir(launch.private_dir)
            launch = dataclasses.replace(launch, private_dir=None)
        outbox_send, outbox_receive = trio.open_memory_channel[EngineResponse](OUTBOX_SIZE)
        death = DeathReport(outbox_send)
        api_servers = ApiServers(engine_index, launch) if init.frontends is not None else None
        # A front-end on another host did not stop this engine core itself: it must hear of a stop here
        # (the headless process's, a SIGTERM) at once, not find it silent a heartbeat timeout later. So
        # there the output socket outlives a stop too, until the report is sent.
        remote = init.output_address.startswith("tcp://")
        output_shield = trio.CancelScope(shield=remote)
        async with trio.open_nursery() as outer:
            # The output socket outlives the rest, so that a failure can be reported.
            route = None if api_servers is None else api_servers.route
            output = functools.partial(output_socket_actor, options=launch.socket_options(init.output_address))
            await outer.start(
                _within, output_shield, output, init.output_address, outbox_receive, death.take_unsent, route
            )
            try:
                await _serve(init, launch, handshake, outbox_send, death, (outer, api_servers))
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
    launch: EngineCoreLaunch,
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
        address = launch.handshake_address
        private_dir = ipc_directory(address) or launch.private_dir
        executor = Executor(
            config,
            in_flight,
            on_failure=death.report,
            data_parallel=init.data_parallel,
            engine_index=launch.engine_index,
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
        options = launch.socket_options(init.input_address)
        receive = functools.partial(input_socket_actor, options=options)
        await nursery.start(receive, init.input_address, inbox_send, heard, False, note, left)
        bound = None  # where the API servers connect
        if api_servers is not None and api_servers[1] is not None and init.frontends is not None:
            start = functools.partial(api_servers[1].run, init.frontends, info, inbox_send)
            bound = await _listen_for_api_servers(api_servers[0], start, handshake, launch.process)
        await handshake.send(_encode(Ready(info=info, frontends=bound)))
        lockstep = None if init.data_parallel is None else EngineWaves(init.data_parallel.rank)
        core = EngineCore(scheduler, executor, info, in_flight, lockstep)
        nursery.start_soon(_heartbeats, outbox.send, executor, core)
        await core.step_loop(inbox_receive, outbox)


async def _listen_for_api_servers(
    nursery: trio.Nursery, run: Callable[..., Awaitable[None]], handshake: TrioZmqSocket, process: str
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
