"""The front-end's side of one engine core: its sockets, its requests, its calls.

Task tree (inside the caller's ``trio.run``)::

    EngineCoreClient.run              one life of the engine core
    ├── (the strategy's tasks)        local.py: the engine-core process, supervised;
    │                                 remote.py: a Ping every heartbeat interval;
    │                                 attached.py: the watch of its connection
    ├── input sender                  outbox (in order; bounded for new work) -> ZMQ PUSH (requests, aborts, calls)
    ├── output handler                ZMQ PULL -> detokenize -> each request's mailbox; replies; heartbeats
    └── watchdog                      silent for heartbeat_timeout_s: hung

How the engine core is reached is the client's ``EngineCoreStrategy``: a
process started here (``local.py``), an engine core that joins from another
host (``remote.py``), or one another process supervises (``attached.py``,
an API server of several); the strategy also says what a hang does, what a
death does beyond failing the requests, and what is sent last.

Every request has its own one-slot mailbox (``OutputCollector``), so a slow
consumer never stalls the output handler. Submitting a request is atomic
with respect to cancellation: it is registered and queued for the engine,
or neither. When the engine core dies, its requests in flight go to
``on_orphans`` (the engine group's resumptions, ``resume.py``), or fail.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Protocol

import msgspec
import trio

from trioserve.config import EngineConfig
from trioserve.errors import (
    ControlCallError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestError,
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
    Heartbeat,
    LoadReport,
    PrefixCacheReset,
    ResetPrefixCache,
    StartWave,
    StatsReply,
    WaveNotice,
)
from trioserve.rpc import ControlCall, ControlReply, ControlRequest, GenerationState, Pause, Sleep
from trioserve.transport.outbox import Outbox
from trioserve.transport.silence import Silence
from trioserve.transport.zmq_trio import TrioZmqSocket

TO_ENGINE_SIZE = 1024  # messages queued for the input socket
CONTROL_REPLY_GRACE_S = 1.0  # beyond a control call's deadline, for its reply to come back
log = logging.getLogger("trioserve.client")
_encode = msgspec.msgpack.Encoder().encode


class EngineCoreStrategy(Protocol):
    """How a client reaches the engine core of one life, and what it does
    when that life goes wrong. One strategy object serves one client."""

    # This front-end's index among the API servers (-1: the engine core's own front-end).
    frontend_index: int

    def life(self, client: EngineCoreClient) -> contextlib.AbstractAsyncContextManager[None]:
        """Entered around the whole life, its start and its serving: what it
        holds (the private directory of a local engine core's sockets), and
        how the life's end is told (an exit, a failed join)."""
        ...

    async def start(self, client: EngineCoreClient, nursery: trio.Nursery) -> EngineInfo:
        """Start the engine core (or wait for it to join, or attach to it),
        and the client's socket actors in ``nursery`` (``client.serve``);
        the engine's info. Start-up failures raise ``EngineStartupError``."""
        ...

    def hung(self, client: EngineCoreClient) -> None:
        """The engine core is declared hung: what that does (kill it, or end the life)."""
        ...

    def died(self, client: EngineCoreClient) -> None:
        """The engine core was declared dead (again, perhaps) and its requests failed: anything more to do."""
        ...

    def last_words(self, client: EngineCoreClient, sock: TrioZmqSocket) -> None:
        """The input socket is about to close (the life ends): what to send last, without waiting."""
        ...


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        engine_index: int,
        strategy: EngineCoreStrategy,
        *,
        on_dead: Callable[[EngineCoreClient], None] | None = None,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self._on_dead = on_dead
        # Told each load report (engine index, load); the engine group's coordinator sets it.
        self.on_load: Callable[[int, LoadReport], None] | None = None
        # Given the requests in flight when the engine core dies (else they fail); the engine group sets it.
        self.on_orphans: Callable[[EngineCoreClient, list[RequestState]], None] | None = None
        self._dead_event = trio.Event()
        self.name = f"engine-core-{engine_index}"
        self.engine_index = engine_index
        self.info: EngineInfo | None = None
        self.handshake_init: HandshakeInit | None = None  # what the engine core was told at its handshake
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
        self.frontend_index = strategy.frontend_index
        self._calls: dict[int, tuple[trio.Event, list[StatsReply | PrefixCacheReset]]] = {}  # by call id
        self._control_calls: dict[int, tuple[trio.Event, list[ControlReply]]] = {}
        # Paused, asleep: the engine core's word, from its last reply to any front-end's call or heartbeat.
        self.state = GenerationState()
        self.asking: list[ControlCall] = []  # this front-end's calls not answered yet
        self._call_ids = itertools.count(max(self.frontend_index, 0) << 32)  # an API server's own
        self._dead: EngineDeadError | None = None
        self._silence = Silence()  # since any message from the engine core (this process's absences excused)
        self._engine_stalled = ""  # what its last heartbeat said

    # --- life cycle ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine core (as the strategy does), hand back its
        ``EngineInfo``, then serve until cancelled. Start-up failures raise
        ``EngineStartupError`` naming the stage. If the engine core dies
        later, every request in flight (and every later one) fails with
        ``EngineDeadError`` and this returns. If cancelled, a local engine
        core is asked to stop, then terminated, and always reaped.
        """
        async with self.strategy.life(self), trio.open_nursery() as nursery:
            self.info = await self.strategy.start(self, nursery)
            task_status.started(self.info)

    def serve(self, nursery: trio.Nursery, input_sock: TrioZmqSocket, output_sock: TrioZmqSocket) -> None:
        """After the handshake: the socket actors, and the watchdog, in ``nursery``."""
        self._silence = Silence()
        nursery.start_soon(self._input_sender, input_sock)
        nursery.start_soon(self._output_handler, output_sock)
        nursery.start_soon(self._watchdog)

    async def _watchdog(self) -> None:
        """Declare the engine core hung when it sends nothing, not even a
        heartbeat, for ``heartbeat_timeout_s``: its requests fail at once,
        then it is dealt with as the strategy says (killed with its process
        group; or the life ends). Time this process itself did not run (it
        was stopped, or its loop held up) is not the engine core's silence
        (``transport/silence.py``). Cancelling this leaves nothing behind."""
        timeout = self.config.heartbeat_timeout_s
        await self._silence.wait(timeout)
        pid = self.info.engine_pid if self.info is not None else "?"
        self.die(
            f"{self.name} (pid {pid}) sent nothing for {self._silence.silent_for():.1f}s "
            f"(heartbeat_timeout_s={timeout}s): hung (stopped, or stuck), killed"
        )
        self.declare_hung()

    def declare_hung(self) -> None:
        """The engine core is hung: kill it (and its process group), or end the life (the strategy's choice)."""
        self.strategy.hung(self)

    @property
    def stalled(self) -> str:
        """Why a hang is suspected (the engine core said so in its last
        heartbeat, or it has been silent for two), or ``""``."""
        silent = self._silence.silent_for()
        if self.info is not None and self._dead is None and silent > 2 * self.config.heartbeat_interval_s:
            return f"{self.name} silent for {silent:.1f}s"
        return self._engine_stalled

    def die(self, reason: str) -> None:
        """The engine core is dead (it said so, it is hung, its connection
        closed): every call here fails with ``EngineDeadError`` naming
        ``reason`` (the first one given), and so does every later one; its
        requests in flight go to ``on_orphans`` (else they fail so too).
        Never blocks."""
        first = self._dead is None
        if self._dead is None:
            self._dead = EngineDeadError(f"{self.name} died: {reason}")
            log.error("%s", self._dead)
        orphans = list(self.requests.values())
        self.requests.clear()
        for state in orphans:
            state.client = None
            if self.on_orphans is None:
                state.collector.fail(self._dead)
        for event, _ in self._calls.values():
            event.set()
        for event, _ in self._control_calls.values():
            event.set()
        if first:
            self._dead_event.set()
            if self._on_dead is not None:
                self._on_dead(self)
        if orphans and self.on_orphans is not None:
            self.on_orphans(self, orphans)
        self.strategy.died(self)

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

    async def submit(self, state: RequestState, wave: int = 0, *, resumed: bool = False) -> None:
        """Register the request and queue it for the engine core (in lockstep,
        stamped with the request ``wave`` the coordinator believes current);
        ``state.client`` is this once it is queued. A request whose consumer
        aborted it meanwhile is aborted behind it.

        Raises ``EngineOverloadedError`` at once when ``max_num_seqs +
        max_waiting_requests`` requests are already in flight here (not for
        a request ``resumed`` from a dead engine core: it was admitted
        before). Atomic with respect to cancellation: if cancelled, the
        request was neither registered nor sent.
        """
        self.check_alive()
        limit = self.config.max_num_seqs + self.config.max_waiting_requests
        if len(self.requests) >= limit and not resumed:
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
            if self.requests.get(state.request_id) is state:  # (else the engine core died meanwhile)
                del self.requests[state.request_id]
            raise
        if self.requests.get(state.request_id) is state:  # (else the engine core died meanwhile: an orphan)
            state.client = self
            if state.aborted:
                self.abort(state.request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request here and abort it in the engine core. Never blocks."""
        if self.requests.pop(request_id, None) is None or self._dead is not None:
            return
        self._send_abort(request_id)

    def abort_frontend(self, frontend: int, pid: int) -> None:
        """API server ``frontend`` (process ``pid``) died: the engine core
        aborts every request it sent. Never blocks."""
        if self._dead is None:
            self.send_nowait(_encode(AbortRequests(request_ids=[], frontend=frontend, frontend_pid=pid)))

    def start_wave(self, msg: StartWave) -> None:
        """Lockstep: tell the engine core to run a request wave. Never blocks."""
        if self._dead is None:
            self.send_nowait(_encode(msg))

    def stop_now(self, reason: str) -> None:
        """The engine core must go at once (lockstep: a peer died, and this
        one may be stuck in their collective; or another took its place):
        its requests fail with ``reason`` and it is dealt with as hung
        (killed with its process group, then reaped; or the life ends)."""
        self.die(reason)
        self.declare_hung()

    def send_nowait(self, payload: bytes) -> None:
        """Queue an encoded message for the engine core, behind what is queued. Never blocks."""
        self._to_engine.put_nowait(payload)

    def _send_abort(self, request_id: str) -> None:
        # Behind the request's own AddRequest if that is still queued: the
        # engine core ignores an abort of a request it does not know.
        self._to_engine.put_nowait(_encode(AbortRequests(request_ids=[request_id])))

    # --- calls --------------------------------------------------------------

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
                self.strategy.last_words(self, sock)

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
                    self.die(msg.reason)

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
