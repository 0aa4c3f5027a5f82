"""The front-end's side of one engine core: its process, sockets and requests.

Task tree (inside the caller's ``trio.run``)::

    EngineCoreClient.run
    ├── engine-core process   supervised; its exit raises ProcessExited here
    ├── input sender          outbox (in order; bounded for new work) -> ZMQ PUSH (requests, aborts, calls)
    └── output handler        ZMQ PULL -> detokenize -> each request's mailbox

Every request has its own one-slot mailbox (``OutputCollector``), so a slow
consumer never stalls the output handler. Submitting a request is atomic
with respect to cancellation: it is registered and queued for the engine,
or neither.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import msgspec
import trio
import zmq

from trioserve.config import EngineConfig
from trioserve.errors import (
    ControlCallError,
    EngineDeadError,
    EngineOverloadedError,
    EngineStartupError,
    InvalidRequestError,
    RequestError,
    StartupStage,
)
from trioserve.frontend.requests.state import RequestState
from trioserve.messages import (
    AbortRequests,
    DataParallelInit,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    EngineResponse,
    EngineStats,
    FrontEndsInit,
    GetStats,
    HandshakeInit,
    HandshakeMessage,
    Heartbeat,
    Hello,
    LoadReport,
    PrefixCacheReset,
    Ready,
    ResetPrefixCache,
    StartupFailed,
    StartWave,
    StatsReply,
    WaveNotice,
)
from trioserve.nurseries.engine_core.launch import EngineCoreLaunch, ipc_directory
from trioserve.nurseries.supervision.process import ChildProcess, ProcessExited, python_argv, supervise_process
from trioserve.rpc import ControlCall, ControlReply, ControlRequest, GenerationState, Pause, Sleep
from trioserve.transport.outbox import Outbox
from trioserve.transport.silence import Silence
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir

TO_ENGINE_SIZE = 1024  # messages queued for the input socket
CONTROL_REPLY_GRACE_S = 1.0  # beyond a control call's deadline, for its reply to come back
log = logging.getLogger("trioserve.client")
LAST_WORDS_S = 0.02  # after an engine core's exit, for its death report (already in the socket) to be read
_encode = msgspec.msgpack.Encoder().encode
_decode_handshake: Callable[[bytes], HandshakeMessage] = msgspec.msgpack.Decoder(HandshakeMessage).decode


class HandshakeSocket(Protocol):
    """What the handshake needs of its socket: a ROUTER's frames (identity, message)."""

    async def recv_multipart(self) -> list[bytes]: ...

    async def send_multipart(self, frames: Sequence[bytes]) -> None: ...


class EngineCoreClient:
    # Each life binds its sockets in a private directory of its own; a client
    # that starts no engine core (remote, attached) sets this False and makes
    # none (so that a kill -9 of its process cannot leave one behind).
    uses_ipc_dir = True

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        *,
        on_dead: Callable[[EngineCoreClient], None] | None = None,
    ) -> None:
        self.config = config
        self._on_dead = on_dead
        # Told each load report (engine index, load); the engine group's coordinator sets it.
        self.on_load: Callable[[int, LoadReport], None] | None = None
        self._dead_event = trio.Event()
        self.name = f"engine-core-{engine_index}"
        self.engine_index = engine_index
        self.info: EngineInfo | None = None
        self.handshake_init: HandshakeInit | None = None  # what the engine core was told at its handshake
        self.process: ChildProcess | None = None
        self.requests: dict[str, RequestState] = {}
        # Encoded messages for the input socket: a request is encoded when it is
        # submitted, so that one the wire cannot carry fails alone, there.
        # New work waits while TO_ENGINE_SIZE are queued; aborts and wave starts
        # never wait, and never pass what was queued before them.
        self._to_engine: Outbox[bytes] = Outbox(TO_ENGINE_SIZE)
        # Told each lockstep wave notice; the engine group's coordinator sets it.
        self.on_wave: Callable[[WaveNotice], None] | None = None
        # Lockstep: this engine core's place among the engines, for its handshake.
        self.data_parallel: DataParallelInit | None = None
        # Several API-server processes: where the engine core listens for them too.
        self.frontends: FrontEndsInit | None = None
        self.frontends_bound: FrontEndsInit | None = None  # ... and where it did, as its Ready said
        self.frontend_index = -1  # this front-end's index among the API servers (-1: the engine core's own)
        self._calls: dict[int, tuple[trio.Event, list[StatsReply | PrefixCacheReset]]] = {}  # by call id
        self._control_calls: dict[int, tuple[trio.Event, list[ControlReply]]] = {}
        # Paused, asleep: the engine core's word, from its last reply to any front-end's call or heartbeat.
        self.state = GenerationState()
        self.asking: list[ControlCall] = []  # this front-end's calls not answered yet
        self._call_ids = itertools.count()
        self._stage: StartupStage = "spawn"
        self._startup_failed: StartupFailed | None = None
        self._dead: EngineDeadError | None = None
        self._silence = Silence()  # since any message from the engine core (this process's absences excused)
        self._engine_stalled = ""  # what its last heartbeat said

    # --- life cycle ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine core, hand back its ``EngineInfo``, then serve until
        cancelled. Start-up failures raise ``EngineStartupError`` naming the
        stage. If the engine core dies later, every request in flight (and every
        later one) fails with ``EngineDeadError`` and this returns. If cancelled,
        the engine core is asked to stop, then terminated, and always reaped.
        """
        directory: contextlib.AbstractContextManager[Path | None] = (
            private_ipc_dir(socket_names=self._socket_names()) if self.uses_ipc_dir else contextlib.nullcontext()
        )
        try:
            with directory as ipc_dir:
                async with trio.open_nursery() as nursery:
                    self.info = await self._start(nursery, str(ipc_dir or ""))
                    task_status.started(self.info)
        except* ProcessExited as group:
            exited = group.exceptions[0]
            assert isinstance(exited, ProcessExited)
            if self.info is None:
                raise self._startup_error(exited) from None
            self._die(str(exited))

    def _socket_names(self) -> tuple[str, str, str]:
        """The sockets ``_start`` binds in the private directory: handshake, input, output."""
        return "handshake", f"input-{self.engine_index}", "output"

    async def _start(self, nursery: trio.Nursery, ipc_dir: str) -> EngineInfo:
        handshake_address, input_address, output_address = (f"ipc://{ipc_dir}/{n}" for n in self._socket_names())
        handshake = TrioZmqSocket.bind(zmq.ROUTER, handshake_address, linger=0)
        input_sock = TrioZmqSocket.bind(zmq.PUSH, input_address, linger=0)
        output_sock = TrioZmqSocket.bind(zmq.PULL, output_address, linger=0)
        with handshake:
            launch = EngineCoreLaunch(
                handshake_address=handshake_address,
                engine_index=self.engine_index,
                handshake_timeout_s=self.config.startup_timeout_s,
                api_servers_dir=None if self.frontends is None else ipc_directory(self.frontends.input_address),
            )
            env = launch.env(os.environ)
            try:
                self.process = await nursery.start(self._supervise, env, nursery.cancel_scope)
            except OSError as exc:  # no process: fork failed (EAGAIN: the process table is full; ENOMEM)
                raise EngineStartupError(f"could not start {self.name}: {exc}", stage="spawn", process=self.name)
            info = await self._handshake(handshake, input_address, output_address)
        self._serve_sockets(nursery, input_sock, output_sock)
        return info

    def _serve_sockets(self, nursery: trio.Nursery, input_sock: TrioZmqSocket, output_sock: TrioZmqSocket) -> None:
        """After the handshake: the socket actors, and the watchdog."""
        self._silence = Silence()
        nursery.start_soon(self._input_sender, input_sock)
        nursery.start_soon(self._output_handler, output_sock)
        nursery.start_soon(self._watchdog)

    async def _supervise(
        self,
        env: dict[str, str],
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The engine-core process, leading a process group of its own (its
        workers join it, so a kill of the group leaves none behind). Its
        unexpected exit raises ``ProcessExited`` (after a moment in which
        the output socket reads what it sent last: its own death report names
        the cause better than its exit code); once it was killed as hung and
        reaped, the client is done: ``scope`` is cancelled."""
        argv = python_argv("trioserve.nurseries.supervision.entry", "engine-core")
        try:
            await supervise_process(
                argv,
                name=self.name,
                env=env,
                grace_s=self.config.shutdown_grace_s,
                new_process_group=True,
                task_status=task_status,
            )
        except ProcessExited:
            if self.info is not None and self._dead is None:
                await trio.sleep(LAST_WORDS_S)
            raise
        scope.cancel()

    async def _watchdog(self) -> None:
        """Declare the engine core hung when it sends nothing, not even a
        heartbeat, for ``heartbeat_timeout_s``: its requests fail at once,
        then it (and its process group) is killed. Time this process itself
        did not run (it was stopped, or its loop held up) is not the engine
        core's silence (``transport/silence.py``). Cancelling this leaves
        nothing behind."""
        timeout = self.config.heartbeat_timeout_s
        await self._silence.wait(timeout)
        pid = self.process.pid if self.process is not None else self.info.engine_pid if self.info else "?"
        self._die(
            f"{self.name} (pid {pid}) sent nothing for {self._silent_for():.1f}s "
            f"(heartbeat_timeout_s={timeout}s): hung (stopped, or stuck), killed"
        )
        self._hung()

    def _hung(self) -> None:
        """The engine core is declared hung: kill it (and its process group)."""
        if self.process is not None:
            self.process.declare_hung()

    def _silent_for(self) -> float:
        return self._silence.silent_for()

    @property
    def stalled(self) -> str:
        """Why a hang is suspected (the engine core said so in its last
        heartbeat, or it has been silent for two), or ``""``."""
        silent = self._silent_for()
        if self.info is not None and self._dead is None and silent > 2 * self.config.heartbeat_interval_s:
            return f"{self.name} silent for {silent:.1f}s"
        return self._engine_stalled

    async def _handshake(self, sock: HandshakeSocket, input_address: str, output_address: str) -> EngineInfo:
        self._stage = "handshake"
        with trio.move_on_after(self.config.startup_timeout_s) as waited:
            identity, raw = await sock.recv_multipart()
            hello = _decode_handshake(raw)
            if not isinstance(hello, Hello) or hello.engine_index != self.engine_index:
                raise EngineStartupError(
                    f"unexpected handshake message {hello!r}", stage="handshake", process=self.name
                )
            init = HandshakeInit(
                data_parallel=self.data_parallel,
                frontends=self.frontends,
                config=self.config,
                input_address=input_address,
                output_address=output_address,
            )
            self.handshake_init = init
            await sock.send_multipart([identity, _encode(init)])
        if waited.cancelled_caught:
            raise EngineStartupError(
                f"{self.name} did not say hello within startup_timeout_s={self.config.startup_timeout_s}s",
                stage="handshake",
                process=self.name,
            )
        self._stage = "model-load"
        reply = await self._wait_ready(sock)
        if isinstance(reply, StartupFailed):
            self._startup_failed = reply
            self._stage = reply.stage
            if self.process is not None:  # one of ours: its exit arrives as ProcessExited
                with trio.move_on_after(self.config.shutdown_grace_s):
                    await trio.sleep_forever()
            raise self._startup_error(None)
        if not isinstance(reply, Ready):
            raise EngineStartupError(f"unexpected handshake message {reply!r}", stage="handshake", process=self.name)
        self.frontends_bound = reply.frontends
        return reply.info

    async def _wait_ready(self, sock: HandshakeSocket) -> HandshakeMessage:
        """The engine core's answer once its workers are loaded (``Ready`` or
        ``StartupFailed``), reading past its heartbeats. An engine core that
        sends nothing for ``heartbeat_timeout_s`` is killed as hung; the
        overall bound (the engine core's own deadline for its workers comes
        first, with a more precise error) guards against one that beats but
        never answers."""
        deadline = trio.current_time() + self.config.model_load_timeout_s + self.config.startup_timeout_s
        silence = Silence()
        with trio.move_on_at(deadline):
            async with silence.watched(self.config.heartbeat_timeout_s):
                while True:
                    _, raw = await sock.recv_multipart()
                    silence.heard()
                    reply = _decode_handshake(raw)
                    if not isinstance(reply, Heartbeat):
                        return reply
        self._hung()
        hung = f"sent nothing for {self.config.heartbeat_timeout_s}s: hung (stopped, or stuck), killed"
        slow = "was not ready within model_load_timeout_s + startup_timeout_s"
        raise EngineStartupError(
            f"{self.name} {hung if silence.expired else slow}",
            stage="model-load",
            process=self.name,
        )

    def _startup_message(self, exited: ProcessExited | None = None) -> str:
        parts = [f"{self.name} failed to start during {self._stage}"]
        if self._startup_failed is not None:
            parts.append(self._startup_failed.message)
        if exited is not None:
            parts.append(str(exited))
        return ": ".join(parts)

    def _startup_error(self, exited: ProcessExited | None) -> EngineStartupError:
        """The error names the process that failed: the one the engine core
        reported (itself or a worker), else the engine core as it exited."""
        process, exit_code = self.name, None
        if exited is not None:
            process, exit_code = exited.name, exited.exit_code
        reported = self._startup_failed
        if reported is not None and reported.process:
            process, exit_code = reported.process, reported.exit_code
        return EngineStartupError(
            self._startup_message(exited), stage=self._stage, process=process, exit_code=exit_code
        )

    def _die(self, reason: str) -> None:
        first = self._dead is None
        if self._dead is None:
            self._dead = EngineDeadError(f"{self.name} died: {reason}")
            log.error("%s", self._dead)
        for state in self.requests.values():
            state.collector.fail(self._dead)
        self.requests.clear()
        for event, _ in self._calls.values():
            event.set()
        for event, _ in self._control_calls.values():
            event.set()
        if first:
            self._dead_event.set()
            if self._on_dead is not None:
                self._on_dead(self)

    async def wait_dead(self) -> None:
        """Wait until the engine core is known dead."""
        await self._dead_event.wait()

    @property
    def dead(self) -> EngineDeadError | None:
        return self._dead

    def check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self.info is None:
            raise EngineDeadError(f"{self.name} is not running")

    # --- requests -----------------------------------------------------------

    async def submit(self, state: RequestState, wave: int = 0) -> None:
        """Register the request and queue it for the engine core (in lockstep,
        stamped with the request ``wave`` the coordinator believes current).

        Raises ``EngineOverloadedError`` at once when ``max_num_seqs +
        max_waiting_requests`` requests are already in flight here. Atomic
        with respect to cancellation: if cancelled, the request was neither
        registered nor sent.
        """
        self.check_alive()
        limit = self.config.max_num_seqs + self.config.max_waiting_requests
        if len(self.requests) >= limit:
            raise EngineOverloadedError(
                f"{self.name} has {len(self.requests)} requests in flight, as many as it takes "
                f"(max_num_seqs + max_waiting_requests = {limit}); retry later"
            )
        try:
            add = state.add_request(wave)
            add.frontend = self.frontend_index
            payload = _encode(add)
        except (OverflowError, msgspec.EncodeError, UnicodeEncodeError) as exc:
            raise InvalidRequestError("request", f"cannot be encoded for the engine: {exc}") from None
        if state.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{state.request_id!r} is already in flight")
        self.requests[state.request_id] = state
        try:
            await self._to_engine.put(payload)
        except BaseException:
            del self.requests[state.request_id]
            raise

    def abort(self, request_id: str) -> None:
        """Forget the request here and abort it in the engine core. Never blocks."""
        if self.requests.pop(request_id, None) is None or self._dead is not None:
            return
        self._send_abort(request_id)

    def abort_frontend(self, frontend: int, pid: int) -> None:
        """API server ``frontend`` (process ``pid``) died: the engine core
        aborts every request it sent. Never blocks."""
        if self._dead is None:
            self._send_nowait(_encode(AbortRequests(request_ids=[], frontend=frontend, frontend_pid=pid)))

    def start_wave(self, msg: StartWave) -> None:
        """Lockstep: tell the engine core to run a request wave. Never blocks."""
        if self._dead is None:
            self._send_nowait(_encode(msg))

    def stop_now(self, reason: str) -> None:
        """The engine core must go at once (lockstep: a peer died, and this
        one may be stuck in their collective): its requests fail with
        ``reason`` and it is killed (its process group too), then reaped."""
        self._die(reason)
        self._hung()

    def _send_nowait(self, payload: bytes) -> None:
        self._to_engine.put_nowait(payload)

    def _send_abort(self, request_id: str) -> None:
        # Behind the request's own AddRequest if that is still queued: the
        # engine core ignores an abort of a request it does not know.
        self._to_engine.put_nowait(_encode(AbortRequests(request_ids=[request_id])))

    async def stats(self) -> EngineStats:
        """Ask the engine core for its statistics. If cancelled, the reply is dropped."""
        reply = await self._call(GetStats(call_id=next(self._call_ids)))
        assert isinstance(reply, StatsReply)
        return reply.stats

    async def reset_prefix_cache(self) -> int:
        """Make the engine core forget every cached prefix; how many blocks it
        forgot. If cancelled, the reset may or may not happen."""
        reply = await self._call(ResetPrefixCache(call_id=next(self._call_ids)))
        assert isinstance(reply, PrefixCacheReset)
        return reply.num_blocks

    async def _call(self, msg: GetStats | ResetPrefixCache) -> StatsReply | PrefixCacheReset:
        """Send ``msg`` and wait for the reply with its call id. Raises
        ``EngineDeadError`` if the engine core dies first."""
        self.check_alive()
        event, result = trio.Event(), list[StatsReply | PrefixCacheReset]()
        self._calls[msg.call_id] = (event, result)
        try:
            await self._to_engine.put(_encode(msg))
            await event.wait()
        finally:
            del self._calls[msg.call_id]
        self.check_alive()
        return result[0]

    async def control(self, call: ControlCall, timeout_s: float) -> ControlReply:
        """Send the engine core a control call; its reply.

        The workers get ``timeout_s`` to answer (past it the engine core
        kills them as hung and dies); the reply gets ``CONTROL_REPLY_GRACE_S``
        more. A pause or sleep counts from now for ``health``, until the
        engine core's next word on it (its reply; if this is cancelled, its
        next heartbeat). Raises
        ``ControlCallError`` (naming the rank when a worker raised; the
        engine serves on) or, if the engine core died, ``EngineDeadError``.
        If cancelled, the reply is dropped (the call may still take effect).
        """
        self.check_alive()
        call_id = next(self._call_ids)
        event, result = trio.Event(), list[ControlReply]()
        self._control_calls[call_id] = (event, result)
        before = self.state
        if isinstance(call, Pause | Sleep):
            self.state = msgspec.structs.replace(before, holding=True)  # new requests wait from now on
        assumed = self.state
        self.asking.append(call)
        sent = False
        try:
            await self._to_engine.put(_encode(ControlRequest(call_id=call_id, call=call, timeout_s=timeout_s)))
            sent = True
            with trio.move_on_after(timeout_s + CONTROL_REPLY_GRACE_S):
                await event.wait()
        finally:
            del self._control_calls[call_id]
            self.asking.remove(call)
            if not sent and self.state is assumed:  # cancelled before it went out: nothing changes
                self.state = before
        self.check_alive()
        if not result:
            raise ControlCallError(f"{self.name}: {type(call).__name__} was not answered within {timeout_s}s")
        reply = result[0]
        if reply.error:
            raise ControlCallError(reply.error)
        return reply

    # --- socket actors ------------------------------------------------------

    async def _input_sender(self, sock: TrioZmqSocket) -> None:
        with sock:
            try:
                while True:
                    await sock.send(await self._to_engine.get())
            finally:
                self._last_words(sock)

    def _last_words(self, sock: TrioZmqSocket) -> None:
        """The input socket is about to close (the life ends): what to send
        last, without waiting. Nothing here: a local engine core is stopped by
        its process's supervision."""

    async def _output_handler(self, sock: TrioZmqSocket) -> None:
        decoder = msgspec.msgpack.Decoder(EngineResponse)
        with sock:
            while True:
                msg = decoder.decode(await sock.recv())
                self._silence.heard()
                if isinstance(msg, EngineOutputs):
                    self._dispatch(msg)
                elif isinstance(msg, StatsReply | PrefixCacheReset):
                    call = self._calls.get(msg.call_id)
                    if call is not None:
                        call[1].append(msg)
                        call[0].set()
                elif isinstance(msg, WaveNotice):
                    if self.on_wave is not None:
                        self.on_wave(msg)
                elif isinstance(msg, ControlReply):
                    self.state = msg.state  # whichever front-end's call it answers
                    control = self._control_calls.get(msg.call_id)
                    if control is not None:
                        control[1].append(msg)
                        control[0].set()
                elif isinstance(msg, LoadReport):
                    self._report_load(msg)
                elif isinstance(msg, Heartbeat):
                    self._engine_stalled = msg.stalled
                    if msg.state is not None and not self._control_calls:  # else the reply says it
                        self.state = msg.state
                    if msg.load is not None:
                        self._report_load(msg.load)
                elif isinstance(msg, EngineDead):
                    self._die(msg.reason)

    def _report_load(self, load: LoadReport) -> None:
        if self.on_load is not None:
            self.on_load(self.engine_index, load)

    def _dispatch(self, msg: EngineOutputs) -> None:
        for output in msg.outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted here; the engine's abort is on its way
            if output.finish_reason == "error":
                del self.requests[output.request_id]
                state.collector.fail(RequestError(output.error or "the engine rejected the request"))
                continue
            finished_by_stop_string = state.process(output)
            if state.finished:
                del self.requests[output.request_id]
                if finished_by_stop_string:
                    self._send_abort(output.request_id)
