"""Control calls in the engine core: pause and resume, sleep and wake-up, profiling,
statistics, and calls run on every worker (``rpc.py`` has the closed set).

A call arrives from the front-end as ``ControlRequest`` (or ``GetStats``)
and waits here until the step loop can run it. The controller keeps no
replies: each method returns the ones it makes, and the step loop
(``step_loop.py``) sends them with its next outputs. Calls that need the workers
run between two steps: the step loop first collects every step in flight,
then ``run_ready`` sends the call to every worker and takes each rank's
reply, within the call's deadline (past it the workers count as hung, and
the engine core fails as for a hung step). A worker that raises in a call
answers with its error: the reply names the rank, and the engine serves on.

Invariants:
- while generation is paused, or the model sleeps or is about to
  (``admitting`` is False), a request that arrives is held here, never
  given to the scheduler, until generation resumes (then in arrival
  order); with ``while_asleep="fail"``, one that arrives while the model
  sleeps or is about to fails at once instead;
- ``Pause`` and ``Sleep`` are answered once the scheduler holds no request
  (in ``abort`` mode they are all aborted when the call arrives, each
  ended with finish reason ``abort``); a ``Resume`` (``WakeUp``) that comes
  first answers the pending ``Pause`` (``Sleep``) at once;
- the workers sleep only once no request runs, so no step runs while they
  sleep; a ``Sleep`` that fails on any rank wakes every rank up again;
- a ``Sleep`` forgets every cached prefix (the KV cache it names is freed,
  and a wake-up zeroes it);
- every call is answered exactly once, unless the engine core dies first
  (then the front-end fails it with the engine's death).
"""

from __future__ import annotations

import logging
import os

import msgspec

from trioserve.core.scheduler import Scheduler
from trioserve.messages import (
    AddRequest,
    EngineOutputs,
    EngineResponse,
    GetStats,
    RpcReply,
    StatsReply,
    TokenOutput,
)
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.rpc import (
    AddLora,
    CollectiveRpc,
    ControlReply,
    ControlRequest,
    DescribeShard,
    DropAdapter,
    GenerationState,
    ListLoras,
    LoadAdapter,
    LoraInfo,
    Pause,
    PinAdapter,
    PinLora,
    ProfileShard,
    RemoveLora,
    Resume,
    ShardInfo,
    Sleep,
    SleepShard,
    StartProfile,
    StopProfile,
    TraceFile,
    WakeShard,
    WakeUp,
    WorkerCall,
    WorkerResult,
)
from trioserve.runners.trace import SpanTrace, core_trace_path, trace_prefix

log = logging.getLogger("trioserve.engine_core")
Call = ControlRequest | GetStats


class Controller:
    """One engine core's pause and sleep state, the requests held while it
    does not admit any, and the control calls not yet answered. Each method
    returns the replies it makes, in order, for the step loop to send."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.name = f"engine-core-{executor.engine_index}"
        self.paused = False  # by Pause, until Resume
        self.sleep_level = 0  # the workers sleep (1 or 2), or 0
        self._going_to_sleep: ControlRequest | None = None  # a Sleep waiting for the requests to end
        self._pending: list[Call] = []  # arrival order
        self.held: dict[str, AddRequest] = {}  # arrival order
        self.trace: SpanTrace | None = None  # while a profile is recorded: the step loop's spans
        self._trace_prefix = ""  # ... and where its files go

    @property
    def admitting(self) -> bool:
        return not self.paused and self.sleep_level == 0 and self._going_to_sleep is None

    @property
    def num_held(self) -> int:
        return len(self.held)

    # --- what the front-end sends ----------------------------------------------

    def hold(self, msg: AddRequest) -> list[EngineResponse]:
        """A request that arrives while not admitting: held, or failed at once
        (its error is the reply) while the model sleeps (or is about to) and
        ``while_asleep`` says so."""
        asleep = self.sleep_level or self._going_to_sleep is not None
        if asleep and self.executor.config.while_asleep == "fail":
            error = f"{self.name} is asleep: wake it up first (EngineConfig.while_asleep='fail')"
            return [EngineOutputs([TokenOutput(msg.request_id, [], finish_reason="error", error=error)])]
        self.held[msg.request_id] = msg
        return []

    def drop_held(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.held.pop(request_id, None)

    def submit(self, msg: Call) -> list[EngineResponse]:
        """Take a call; the replies it makes now. ``Pause`` and ``Sleep`` stop
        admitting now (and, in ``abort`` mode, abort every request: their
        ends are the reply); ``Resume`` and ``WakeUp`` answer a ``Pause`` or
        ``Sleep`` still waiting for requests to end."""
        replies: list[EngineResponse] = []
        if isinstance(msg, GetStats):
            self._pending.append(msg)
            return replies
        call = msg.call
        if isinstance(call, Pause | Sleep):
            if isinstance(call, Pause):
                self.paused = True
            elif self._going_to_sleep is None:
                self._going_to_sleep = msg
            else:
                return self._reply(msg, error="a sleep is already under way")
            if call.mode == "abort":
                replies += self._abort_all()
        elif isinstance(call, Resume):
            self.paused = False
            replies += self._answer_waiting(Pause, "")
        elif isinstance(call, WakeUp) and self._going_to_sleep is not None:
            self._going_to_sleep = None
            replies += self._answer_waiting(Sleep, "woken up before the requests had ended: not asleep")
        elif isinstance(call, AddLora | RemoveLora | PinLora) and (error := self._lora_refusal(call)):
            return self._reply(msg, error=error)
        self._pending.append(msg)
        return replies

    def _lora_refusal(self, call: AddLora | RemoveLora | PinLora) -> str:
        """Why an adapter call cannot run (``""`` if it can); a ``RemoveLora``
        stops the adapter taking new requests now."""
        adapters = self.scheduler.adapters
        if not self.executor.config.enable_lora:
            return "LoRA adapters: this engine was started without enable_lora (--enable-lora)"
        try:
            if isinstance(call, AddLora):
                adapters.check_new(call.name)
            elif adapters.get(call.name).removing:
                return f"lora_name: adapter {call.name!r} is being removed"
            elif isinstance(call, RemoveLora):
                adapters.get(call.name).removing = True
        except ValueError as exc:
            return str(exc)
        return ""

    def _abort_all(self) -> list[EngineResponse]:
        aborted = self.scheduler.abort(self.scheduler.request_ids())
        return [EngineOutputs([TokenOutput(r, [], finish_reason="abort") for r in aborted])] if aborted else []

    def _answer_waiting(self, kind: type[Pause | Sleep], error: str) -> list[EngineResponse]:
        replies: list[EngineResponse] = []
        for msg in [m for m in self._pending if isinstance(m, ControlRequest) and isinstance(m.call, kind)]:
            self._pending.remove(msg)
            replies += self._reply(msg, error=error)
        return replies

    # --- run by the step loop ----------------------------------------------------

    def has_ready(self) -> bool:
        """A call can run now (the step loop must then drain its steps and call ``run_ready``,
        then admit what ``release_held`` gives)."""
        return any(self._ready(msg) for msg in self._pending)

    def _ready(self, msg: Call) -> bool:
        if isinstance(msg, ControlRequest) and isinstance(msg.call, Pause | Sleep):
            return not self.scheduler.has_unfinished()
        if isinstance(msg, ControlRequest) and isinstance(msg.call, RemoveLora):  # once no request runs with it
            requests = (self.scheduler.get_request(r) for r in self.scheduler.request_ids())
            return not self.scheduler.adapters.in_use(msg.call.name, (r for r in requests if r is not None))
        return True

    async def run_ready(self) -> list[EngineResponse]:
        """Run every call that can run, in arrival order (no step may be in
        flight); their replies, in that order. If cancelled, the engine core
        is going down: calls not answered die with it."""
        replies: list[EngineResponse] = []
        for msg in [m for m in self._pending if self._ready(m)]:
            self._pending.remove(msg)
            if isinstance(msg, GetStats):
                replies.append(await self._stats(msg))
            else:
                replies += await self._run(msg)
        return replies

    def release_held(self) -> list[AddRequest]:
        """Once admitting again, the held requests in arrival order, no longer
        held (the step loop admits them); else none."""
        if not self.admitting:
            return []
        held, self.held = self.held, {}
        return list(held.values())

    async def _stats(self, msg: GetStats) -> StatsReply:
        """The scheduler's counters (the held requests count as waiting) and every rank's ``ShardInfo``."""
        results, _ = await self._on_workers(DescribeShard(), self.executor.config.control_timeout_s)
        stats = self.scheduler.stats()
        stats = msgspec.structs.replace(
            stats,
            num_waiting=stats.num_waiting + self.num_held,
            workers=[r for r in results if isinstance(r, ShardInfo)],
        )
        return StatsReply(call_id=msg.call_id, stats=stats)

    async def _run(self, msg: ControlRequest) -> list[EngineResponse]:
        call, results, error = msg.call, list[WorkerResult](), ""
        if isinstance(call, CollectiveRpc):
            results, error = await self._on_workers(call.call, msg.timeout_s)
        elif isinstance(call, Sleep):
            if self._going_to_sleep is not msg:
                return []  # answered already (a WakeUp came first)
            self._going_to_sleep = None
            results, error = await self._on_workers(SleepShard(level=call.level), msg.timeout_s)
            # A rank that slept gave its KV cache back, and wakes with a zeroed one: no cached
            # prefix survives (a prompt hitting one after a wake-up would read zeros: wrong tokens).
            self.scheduler.reset_prefix_cache()
            if error:  # some ranks may sleep: wake them all
                await self._on_workers(WakeShard(), msg.timeout_s)
            else:
                self.sleep_level = max(self.sleep_level, call.level)
        elif isinstance(call, WakeUp) and self.sleep_level:
            results, error = await self._on_workers(WakeShard(), msg.timeout_s)
            if not error:
                self.sleep_level = 0
        elif isinstance(call, AddLora | RemoveLora | PinLora | ListLoras):
            results, error = await self._run_lora(call, msg.timeout_s)
        elif isinstance(call, StartProfile | StopProfile):
            results, error = await self._run_profile(call, msg.timeout_s)
        return self._reply(msg, results, error)

    async def _run_profile(self, call: StartProfile | StopProfile, timeout_s: float) -> tuple[list[WorkerResult], str]:
        """Start a recording on every worker and of the step loop's spans
        (``trace``); or stop it, and write every trace: their ``TraceFile``s."""
        directory = self.executor.config.profiler_dir
        if directory is None:
            return [], f"{self.name}: profiling is off: start the engine with --profiler-dir DIR (profiler_dir)"
        if isinstance(call, StopProfile):
            if self.trace is None:
                return [], f"{self.name}: no profile is being recorded (start one first)"
            trace, self.trace = self.trace, None
            results, error = await self._on_workers(
                ProfileShard(start=False, trace_prefix=self._trace_prefix), timeout_s
            )
            try:
                results.append(TraceFile(path=trace.write(core_trace_path(self._trace_prefix)), rank=-1))
            except OSError as exc:
                error = "; ".join(filter(None, [error, f"{self.name}: could not write its trace: {exc}"]))
            log.info(
                "%s: profile written to %s", self.name, ", ".join(r.path for r in results if isinstance(r, TraceFile))
            )
            return results, error
        if self.trace is not None:
            return [], f"{self.name}: a profile is already being recorded (stop it first)"
        try:
            self._trace_prefix = trace_prefix(directory, call.session, self.executor.engine_index)
            os.makedirs(directory, exist_ok=True)
        except (ValueError, OSError) as exc:
            return [], f"{self.name}: profiler_dir: {exc}"
        results, error = await self._on_workers(ProfileShard(start=True), timeout_s)
        if error:  # the ranks that started drop their recording
            await self._on_workers(ProfileShard(start=False), timeout_s)
            return [], error
        self.trace = SpanTrace(f"{self.name} step loop")
        return results, ""

    async def _run_lora(
        self, call: AddLora | RemoveLora | PinLora | ListLoras, timeout_s: float
    ) -> tuple[list[WorkerResult], str]:
        """An adapter call on the workers, then in the scheduler's list: the
        adapters' ``LoraInfo``s (``ListLoras``) or the one named."""
        adapters = self.scheduler.adapters
        if isinstance(call, ListLoras):
            return list(adapters.infos()), ""
        try:  # checked again: a call of the same name may have run since this one was taken
            if isinstance(call, AddLora):
                adapters.check_new(call.name)
            else:
                served = adapters.get(call.name)
        except ValueError as exc:
            return [], str(exc)
        if isinstance(call, AddLora):
            results, error = await self._on_workers(LoadAdapter(call.name, call.path), timeout_s)
            if error:  # the ranks that loaded it forget it again
                await self._on_workers(DropAdapter(call.name), timeout_s)
                return [], error
            ranks = [r.rank for r in results if isinstance(r, LoraInfo)]
            served = adapters.add(call.name, call.path, max(ranks, default=0))
            log.info("%s: LoRA adapter %r loaded from %s (rank %d)", self.name, call.name, call.path, served.rank)
            return [served.info], ""
        if isinstance(call, RemoveLora):
            _, error = await self._on_workers(DropAdapter(call.name), timeout_s)
            del adapters.served[call.name]
            log.info("%s: LoRA adapter %r removed", self.name, call.name)
            return [served.info], error
        _, error = await self._on_workers(PinAdapter(call.name), timeout_s)
        served.pinned = not error
        return [served.info], error

    async def _on_workers(self, call: WorkerCall, timeout_s: float) -> tuple[list[WorkerResult], str]:
        """Every rank's result, and an error naming each rank that raised."""
        replies: list[RpcReply] = await self.executor.rpc(call, timeout_s)
        results = [reply.result for reply in replies if reply.result is not None]
        errors = [
            f"worker-{rank} (rank {rank}) failed {type(call).__name__}: {reply.error}"
            for rank, reply in enumerate(replies)
            if reply.error
        ]
        if errors:
            log.warning("%s: %s", self.name, "; ".join(errors))
        return results, "; ".join(f"{self.name}: {e}" for e in errors)

    def _reply(self, msg: Call, results: list[WorkerResult] | None = None, error: str = "") -> list[EngineResponse]:
        if isinstance(msg, GetStats):
            return []  # a GetStats is answered in run_ready only
        return [ControlReply(call_id=msg.call_id, results=results or [], error=error, state=self.state)]

    @property
    def state(self) -> GenerationState:
        return GenerationState(paused=self.paused, sleep_level=self.sleep_level, holding=not self.admitting)
