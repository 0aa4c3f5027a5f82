"""The engine core's start-up, on the handshake socket (a DEALER connected to the front-end).

1. ``handshake``: send ``Hello``, receive ``HandshakeInit`` within the handshake deadline
   (``TRIOSERVE_HANDSHAKE_TIMEOUT_S``, which the front-end sets to its ``startup_timeout_s``).
2. ``start_executor``: start the workers, with heartbeats on the handshake socket while they load; a front-end on
   another host may say meanwhile that it stops (``Ping(leaving=True)``).
3. ``listen_for_api_servers``: with several API-server processes (``HandshakeInit.frontends``), bind their sockets.
4. ``ready``: reply ``Ready`` (with where the API servers connect).

A failure at 2 or 3 is told to the front-end as ``StartupFailed``, naming the stage, the process and its exit code
(``startup_failure``), and raised. A front-end that says it stops ends this engine core with
``ChildExit(HEAD_LEFT_EXIT)``: nobody to tell.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

import msgspec
import trio
import zmq

from trioserve.errors import EngineStartupError, describe, first_leaf, meaningful_leaves
from trioserve.messages import (
    EngineInfo,
    FrontEndsInit,
    HandshakeInit,
    HandshakeMessage,
    Heartbeat,
    Hello,
    Ping,
    Ready,
    StartupFailed,
)
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.executor.handles import ExecutorStage, WorkerError
from trioserve.nurseries.engine_core.launch import HANDSHAKE_TIMEOUT_ENV, HEAD_LEFT_EXIT
from trioserve.nurseries.engine_core.liveness import heartbeats
from trioserve.nurseries.supervision.child_main import ChildExit, ChildFailed
from trioserve.transport.router import SocketLoop
from trioserve.transport.zmq_trio import TrioZmqSocket

log = logging.getLogger("trioserve.engine_core")
_encode = msgspec.msgpack.Encoder().encode


async def handshake(sock: TrioZmqSocket, engine_index: int, timeout_s: float) -> HandshakeInit:
    """Say ``Hello`` and take the front-end's ``HandshakeInit``; past
    ``timeout_s``, ``ChildFailed`` (nobody to tell: one line on stderr)."""
    with trio.move_on_after(timeout_s):
        await sock.send(_encode(Hello(engine_index=engine_index, pid=os.getpid())))
        msg = msgspec.msgpack.decode(await sock.recv(), type=HandshakeMessage)
        _check_not_leaving(msg)
        if not isinstance(msg, HandshakeInit):
            raise EngineStartupError(f"expected HandshakeInit, got {type(msg).__name__}", stage="handshake")
        return msg
    raise ChildFailed(
        f"engine-core-{engine_index} (pid {os.getpid()}) got no HandshakeInit from the front-end "
        f"within {timeout_s}s ({HANDSHAKE_TIMEOUT_ENV})"
    )


async def ready(sock: TrioZmqSocket, info: EngineInfo, frontends: FrontEndsInit | None) -> None:
    """Tell the front-end that the engine core serves: ``info``, and where the API servers connect."""
    await sock.send(_encode(Ready(info=info, frontends=frontends)))


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


async def start_executor(nursery: trio.Nursery, executor: Executor, sock: TrioZmqSocket, remote: bool) -> EngineInfo:
    """Start the workers, with heartbeats on the handshake socket while they
    load; on a failure, tell the front-end ``StartupFailed`` and raise. With
    a ``remote`` front-end (another host), also listen there meanwhile: a
    head that stops says so (``ChildExit(HEAD_LEFT_EXIT)``, the workers
    stopped first)."""
    loop = SocketLoop(_hear_leaving) if remote else None  # one task owns the socket: it sends and receives

    async def send(msg: Heartbeat) -> None:
        if loop is None:
            await sock.send(_encode(msg))
        else:
            loop.send_nowait([_encode(msg)])
            await trio.lowlevel.checkpoint()

    try:
        async with trio.open_nursery() as beats:
            if loop is not None:
                beats.start_soon(loop.run, sock)
            beats.start_soon(heartbeats, send, executor)
            try:
                info: EngineInfo = await nursery.start(executor.run)
            finally:
                beats.cancel_scope.cancel()
    except BaseException as exc:
        if first_leaf(exc, ChildExit) is not None:
            raise  # the head left: nobody to tell
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await sock.send(_encode(startup_failure(exc, executor.stage)))
        raise
    return info


async def listen_for_api_servers(
    nursery: trio.Nursery, run: Callable[..., Awaitable[None]], sock: TrioZmqSocket, process: str
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
            await sock.send(_encode(StartupFailed(stage="handshake", message=message, process=process)))
        raise EngineStartupError(message, stage="handshake", process=process) from None


def startup_failure(exc: BaseException, stage: ExecutorStage) -> StartupFailed:
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
