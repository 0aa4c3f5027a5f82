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
``StartupFailed`` naming the stage, the process and its exit code).

Any failure after that (a worker that exits, raises, or does not finish a
step within ``step_timeout_s``) is reported to the front-end as
``EngineDead`` with the reason, once the workers are reaped; then the
process exits 1.
"""

from __future__ import annotations

import logging
import math
import os
import traceback
from collections import deque
from typing import Any

import msgspec
import trio
import zmq

from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.errors import EngineStartupError
from trioserve.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineResponse,
    GetStats,
    HandshakeInit,
    HandshakeMessage,
    Hello,
    Ready,
    SchedulerOutput,
    StartupFailed,
    StatsReply,
    TokenOutput,
)
from trioserve.nurseries.executor import Executor, ExecutorInfo
from trioserve.transport.zmq_trio import TrioZmqSocket

HANDSHAKE_ADDRESS_ENV = "TRIOSERVE_HANDSHAKE_ADDRESS"
ENGINE_INDEX_ENV = "TRIOSERVE_ENGINE_INDEX"
# How long the engine core waits for the front-end's HandshakeInit: the
# front-end sets it to its startup_timeout_s.
HANDSHAKE_TIMEOUT_ENV = "TRIOSERVE_HANDSHAKE_TIMEOUT_S"
DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0  # EngineConfig.startup_timeout_s's default
INBOX_SIZE = 1024  # requests and aborts waiting for the step loop
OUTBOX_SIZE = 64  # output batches waiting for the output socket

log = logging.getLogger("trioserve.engine_core")
_encode = msgspec.msgpack.Encoder().encode


class EngineCore:
    """The step loop's state: a scheduler fed from an inbox, results to an outbox."""

    def __init__(self, scheduler: Scheduler, executor: Executor, info: EngineInfo) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.info = info
        self._unsent: list[TokenOutput] = []  # the last step's outputs, not yet in the outbox

    def apply(self, msg: Any, outputs: list[Any]) -> None:
        """Apply one front-end message; replies are appended to ``outputs``."""
        if isinstance(msg, AddRequest):
            self._add(msg, outputs)
        elif isinstance(msg, AbortRequests):
            self.scheduler.abort(msg.request_ids)
        elif isinstance(msg, GetStats):
            outputs.append(StatsReply(call_id=msg.call_id, stats=self.scheduler.stats()))

    def _add(self, msg: AddRequest, outputs: list[Any]) -> None:
        try:
            request = Request(msg.request_id, msg.prompt_token_ids, msg.params, self.info.eos_token_ids)
            self.scheduler.add(request)
        except ValueError as exc:
            # The front-end validates first; this guards against any other sender.
            error = TokenOutput(msg.request_id, [], finish_reason="error", error=str(exc))
            outputs.append(EngineOutputs(outputs=[error]))

    async def step_loop(
        self, inbox: trio.MemoryReceiveChannel[Any], outbox: trio.MemorySendChannel[Any]
    ) -> None:
        """Run steps while there is work; sleep on the inbox when there is none.

        Up to ``max_steps_in_flight`` steps are with the workers at once: the
        next step is planned and sent before the current one's output is
        taken, so the workers go from one step straight to the next. A step's
        outputs go to the front-end once the step after it is on its way.
        """
        in_flight: deque[SchedulerOutput] = deque()
        depth = self.executor.config.max_steps_in_flight
        while True:
            replies: list[Any] = []
            if not in_flight and not self.scheduler.has_unfinished():
                await self._send_outputs(outbox)
                self.apply(await inbox.receive(), replies)
            while True:
                try:
                    self.apply(inbox.receive_nowait(), replies)
                except trio.WouldBlock:
                    break
            for reply in replies:
                await outbox.send(reply)
            sent = False
            if len(in_flight) < depth and self.scheduler.has_unfinished():
                scheduler_output = self.scheduler.schedule()
                # An empty step that names finished requests still goes: the
                # workers must forget them.
                if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids:
                    await self.executor.dispatch(scheduler_output)
                    in_flight.append(scheduler_output)
                    sent = True
            await self._send_outputs(outbox)
            if in_flight and (len(in_flight) == depth or not sent):
                await self._take_output(in_flight.popleft())
            elif not in_flight:
                await trio.lowlevel.checkpoint()

    async def _take_output(self, scheduler_output: SchedulerOutput) -> None:
        runner_output = await self.executor.collect()
        self._unsent += self.scheduler.postprocess(scheduler_output, runner_output)

    async def _send_outputs(self, outbox: trio.MemorySendChannel[Any]) -> None:
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            await outbox.send(EngineOutputs(outputs=outputs))


async def input_socket_actor(
    address: str, inbox: trio.MemorySendChannel[Any], *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Own the input socket: decode each message and pass it to the step loop.

    A message that does not decode is logged and dropped: bad input never
    kills the engine. If cancelled, the socket is closed; nothing is half-read.
    """
    decoder = msgspec.msgpack.Decoder(EngineRequest)
    with TrioZmqSocket.connect(zmq.PULL, address, linger=0) as sock:
        task_status.started()
        async with inbox:
            while True:
                raw = await sock.recv()
                try:
                    msg = decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    log.warning("dropping a malformed message from the front-end: %s", exc)
                    continue
                await inbox.send(msg)


async def output_socket_actor(
    address: str, outbox: trio.MemoryReceiveChannel[Any], *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Own the output socket: send every message from the outbox, in order."""
    with TrioZmqSocket.connect(zmq.PUSH, address, linger=1000) as sock:
        task_status.started()
        async for msg in outbox:
            await sock.send(_encode(msg))


async def _handshake(sock: TrioZmqSocket, engine_index: int) -> HandshakeInit:
    await sock.send(_encode(Hello(engine_index=engine_index, pid=os.getpid())))
    msg = msgspec.msgpack.decode(await sock.recv(), type=HandshakeMessage)
    if not isinstance(msg, HandshakeInit):
        raise EngineStartupError(f"expected HandshakeInit, got {type(msg).__name__}", stage="handshake")
    return msg


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
        log.warning("%s=%r is not a positive number of seconds: using %ss", HANDSHAKE_TIMEOUT_ENV, raw, DEFAULT_HANDSHAKE_TIMEOUT_S)
        return DEFAULT_HANDSHAKE_TIMEOUT_S
    return value


def _startup_failure(exc: BaseException, stage: str) -> StartupFailed:
    """``StartupFailed`` for a start-up that raised ``exc``, while the
    executor was at ``stage``: the stage, process and exit code come from
    the first error that names them (``WorkerError``, ``EngineStartupError``)."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    named = next((leaf for leaf in leaves if getattr(leaf, "process", "")), None)
    return StartupFailed(
        stage=getattr(named, "stage", stage),
        message=_describe(exc),
        process=getattr(named, "process", ""),
        exit_code=getattr(named, "exit_code", None),
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def engine_core_main() -> None:
    engine_index = int(os.environ.get(ENGINE_INDEX_ENV, "0"))
    handshake = TrioZmqSocket.connect(zmq.DEALER, os.environ[HANDSHAKE_ADDRESS_ENV], linger=1000)
    with handshake:
        timeout = handshake_timeout_s()
        with trio.move_on_after(timeout) as scope:
            init = await _handshake(handshake, engine_index)
        if scope.cancelled_caught:
            raise EngineStartupError(
                f"engine-core-{engine_index} (pid {os.getpid()}) got no HandshakeInit from the front-end "
                f"within {timeout}s ({HANDSHAKE_TIMEOUT_ENV})",
                stage="handshake",
                process=f"engine-core-{engine_index}",
            )
        outbox_send, outbox_receive = trio.open_memory_channel[Any](OUTBOX_SIZE)
        async with trio.open_nursery() as outer:
            # The output socket outlives the rest, so that a failure can be reported.
            await outer.start(output_socket_actor, init.output_address, outbox_receive)
            try:
                await _serve(init, handshake, outbox_send)
            except Exception as exc:
                await _report_death(outbox_send, exc)
                raise
            finally:
                outer.cancel_scope.cancel()


async def _serve(init: HandshakeInit, handshake: TrioZmqSocket, outbox: trio.MemorySendChannel[Any]) -> None:
    config = init.config
    async with trio.open_nursery() as nursery:
        executor = Executor(config)
        try:
            executor_info: ExecutorInfo = await nursery.start(executor.run)
        except BaseException as exc:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await handshake.send(_encode(_startup_failure(exc, executor.stage)))
            raise
        info = _engine_info(config.block_size, executor_info)
        scheduler = Scheduler(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=info.max_model_len,
        )
        inbox_send, inbox_receive = trio.open_memory_channel[Any](INBOX_SIZE)
        await nursery.start(input_socket_actor, init.input_address, inbox_send)
        await handshake.send(_encode(Ready(info=info)))
        await EngineCore(scheduler, executor, info).step_loop(inbox_receive, outbox)


def _engine_info(block_size: int, ex: ExecutorInfo) -> EngineInfo:
    # A request alone must always fit in the cache, or preemption could loop:
    # the context length is capped by the cache's size.
    max_model_len = min(ex.max_model_len, ex.num_kv_blocks * block_size)
    return EngineInfo(
        num_kv_blocks=ex.num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=ex.vocab_size,
        eos_token_ids=list(ex.eos_token_ids),
        engine_pid=os.getpid(),
        worker_pids=list(ex.worker_pids),
    )


def _describe(exc: BaseException) -> str:
    leaves = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
    return "; ".join(
        _describe(leaf) if isinstance(leaf, BaseExceptionGroup) else "".join(traceback.format_exception_only(leaf)).strip()
        for leaf in leaves
        if not isinstance(leaf, trio.Cancelled)
    )


async def _report_death(outbox: trio.MemorySendChannel[Any], exc: BaseException) -> None:
    reason = _describe(exc)
    log.error("engine core failed: %s", reason)
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        await outbox.send(EngineDead(reason=reason))
        await trio.sleep(0.05)  # let the output socket hand it to ZMQ
