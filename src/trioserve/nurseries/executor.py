"""The executor: the engine core's handle on its worker processes.

Each worker is a supervised child process with a private framed stream,
bridged to a pair of memory channels. A call goes to every worker; the reply
that counts comes from the output rank (rank 0). The supervising tasks are
the worker monitor: a worker that exits is noticed the moment it is reaped,
and a ``WorkerError`` naming it, the stage (and step) and its exit code or
signal cancels the engine core.

Deadlines: spawning and loading are bounded by ``model_load_timeout_s``, each
step by ``step_timeout_s``. Past one, the error names the workers that did
not answer; cancelling the executor then stops and reaps them.

The executor keeps no record of steps: the step loop owns the queue of steps
in flight (``core.step.Step``) and hands each to ``dispatch`` and ``collect``;
the executor reads that queue (never changes it) to name the step a dead
worker was running.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import NoReturn, TypeVar

import trio

from trioserve.config import EngineConfig
from trioserve.core.step import Step
from trioserve.core.step_timing import StepTiming
from trioserve.errors import EngineStartupError
from trioserve.messages import (
    DataParallelInit,
    EngineInfo,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    RunnerOutput,
    ToWorker,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerInit,
    WorkerLoaded,
)
from trioserve.nurseries.process import ChildProcess, ProcessExited, supervise_process
from trioserve.nurseries.worker import WORKER_FD_ENV
from trioserve.nurseries.workers import ExecutorStage, StepTimeout, WorkerError, WorkerHandle, WorkerHung
from trioserve.transport.framing import MessageBridge, socketpair_for_child

OUTPUT_RANK = 0
# How long a worker that reported a failure, or closed its stream, gets to
# exit, so that the error can name its exit code. It exits at once after its
# last word; this only bounds a worker that does not.
EXIT_WAIT_S = 0.5

_Reply = TypeVar("_Reply", WorkerLoaded, KVCacheReady, RunnerOutput)


class Executor:
    """The engine core's workers. ``steps_in_flight`` is the step loop's own
    queue of the steps sent and not yet collected, oldest first (read only).
    ``on_failure`` is told the reason the moment the workers fail once they
    serve steps, before anything is stopped or reaped, so that the engine
    core can say so at once."""

    def __init__(
        self,
        config: EngineConfig,
        steps_in_flight: Sequence[Step] = (),
        on_failure: Callable[[str], None] | None = None,
        data_parallel: DataParallelInit | None = None,
    ) -> None:
        self.config = config
        self._data_parallel = data_parallel  # lockstep: where the output rank's collective meets
        self._steps_in_flight = steps_in_flight
        self._on_failure = on_failure
        self._reported = False
        self._timing = StepTiming(
            factor=config.step_hang_factor, min_s=config.step_hang_min_s, limit_s=config.step_timeout_s
        )
        self._collect_started_at: float | None = None  # when the running collect() began
        self._workers: list[WorkerHandle] = []
        self.stage: ExecutorStage = "spawn"  # then "model-load", "kv-cache", "step"
        self._collecting = False  # a collect() is taking replies
        self._last_words: dict[int, str] = {}  # rank -> its WorkerFailed message
        self._answered: set[int] = set()  # ranks whose reply the current call has taken

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers, load the model, size the KV cache, then supervise.

        Reports the ``EngineInfo`` once every worker is ready. From the first
        ``WorkerInit`` (sent as soon as the workers are spawned) to the last
        ``KVCacheReady`` the wait is bounded by ``model_load_timeout_s``; past
        it ``EngineStartupError`` names the stage and the workers that did not
        answer. A worker that cannot be spawned raises ``EngineStartupError``
        (stage ``spawn``); one that exits raises ``WorkerError`` with its exit
        code. If cancelled, every worker is asked to stop, then terminated,
        then killed, and always reaped.
        """
        async with trio.open_nursery() as nursery:
            for rank in range(self.config.tensor_parallel_size):
                self._workers.append(await self._start_worker(nursery, rank))
            nursery.start_soon(self._watch_heartbeats)
            info = await self._initialize()
            task_status.started(info)
            await trio.sleep_forever()

    # --- failures ---------------------------------------------------------------

    def _report(self, error: WorkerError) -> WorkerError:
        """Tell ``on_failure`` (once, and only once steps are served); return ``error``."""
        if self.stage == "step" and not self._reported and self._on_failure is not None:
            self._reported = True
            self._on_failure(str(error))
        return error

    async def _watch_heartbeats(self) -> None:
        """Declare hung a worker silent for ``heartbeat_timeout_s`` (before it
        was first heard from: ``startup_timeout_s``, which covers its start)."""
        while True:
            await trio.sleep(self.config.heartbeat_interval_s / 2)
            for worker in self._workers:
                limit = self.config.heartbeat_timeout_s if worker.heard else self.config.startup_timeout_s
                if worker.silent_for() > limit and worker.process is not None and worker.process.returncode is None:
                    self._kill_hung([worker])
                    raise self._report(
                        WorkerHung(
                            f"{worker.name} (pid {worker.pid}) sent nothing for {worker.silent_for():.1f}s "
                            f"(heartbeat_timeout_s={limit}s) during {self._stage_label(worker)}: "
                            "hung (stopped, or stuck), killed",
                            stage=self.stage,
                            process=worker.name,
                        )
                    )

    def _kill_hung(self, workers: list[WorkerHandle]) -> None:
        for worker in workers:
            if worker.process is not None:
                worker.process.declare_hung()

    def suspicion(self) -> str:
        """Why a hang is suspected now (a worker silent for two heartbeats, a
        step past half its deadline), or ``""``."""
        late = [w for w in self._workers if w.heard and w.silent_for() > 2 * self.config.heartbeat_interval_s]
        if late:
            return "; ".join(f"{w.name} silent for {w.silent_for():.1f}s" for w in late)
        if self._collect_started_at is not None and self._steps_in_flight:
            step = self._steps_in_flight[0]
            running = trio.current_time() - self._collect_started_at
            if running > self._timing.deadline(step.num_tokens) / 2:
                return f"step {step.number} has run {running:.1f}s; it may run {self._timing.describe(step.num_tokens)}"
        return ""

    async def _start_worker(self, nursery: trio.Nursery, rank: int) -> WorkerHandle:
        worker = WorkerHandle(rank)
        parent_end, child_end = socketpair_for_child()
        env = {**os.environ, WORKER_FD_ENV: str(child_end.fileno())}
        argv = [sys.executable, "-m", "trioserve.nurseries.entry", "worker"]
        try:
            worker.process = await nursery.start(
                partial(self._monitor, argv, worker, pass_fds=[child_end.fileno()], env=env)
            )
        except OSError as exc:
            await trio.aclose_forcefully(parent_end)
            raise EngineStartupError(f"could not start {worker.name}: {exc}", stage="spawn", process=worker.name)
        finally:
            child_end.close()
        worker.bridge = MessageBridge(parent_end, receive_type=FromWorker, name=worker.name, drop=(WorkerHeartbeat,))
        worker.outbox, worker.inbox = await nursery.start(self._bridge, worker.bridge, worker)
        return worker

    async def _bridge(
        self,
        bridge: MessageBridge[ToWorker, FromWorker],
        worker: WorkerHandle,
        *,
        task_status: trio.TaskStatus[tuple[trio.MemorySendChannel[ToWorker], trio.MemoryReceiveChannel[FromWorker]]],
    ) -> None:
        try:
            await bridge.run(task_status=task_status)
        finally:
            worker.stream_closed.set()

    async def _monitor(
        self,
        argv: list[str],
        worker: WorkerHandle,
        *,
        pass_fds: list[int],
        env: dict[str, str],
        task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The worker monitor: supervise one worker. Its unexpected exit raises
        ``WorkerError`` naming the stage (and step), its exit code or signal
        and its last words (a ``WorkerFailed`` it sent before exiting; the
        stream gets ``EXIT_WAIT_S`` to deliver it). If cancelled, the worker
        is stopped and reaped."""
        try:
            await supervise_process(
                argv,
                name=worker.name,
                pass_fds=pass_fds,
                env=env,
                grace_s=self.config.shutdown_grace_s,
                task_status=task_status,
            )
        except ProcessExited as exc:
            with trio.move_on_after(EXIT_WAIT_S):
                await worker.stream_closed.wait()
            num_replies, failure = worker.drain()
            last_words = self._last_words.get(worker.rank) or failure
            stage = self._stage_label(worker, num_replies)
            message = f"{exc} during {stage}" + (f": {last_words}" if last_words else "")
            raise self._report(
                WorkerError(message, stage=self.stage, process=worker.name, exit_code=exc.exit_code)
            ) from None
        finally:
            worker.exited.set()

    def _stage_label(self, worker: WorkerHandle | None = None, num_replies: int = 0) -> str:
        """The stage; in the step stage, the step being run: the oldest step
        not yet collected or, for a ``worker`` that already answered some of
        the steps in flight (``num_replies`` still in its inbox, and maybe one
        taken by the collect in progress), the first it has not answered."""
        if self.stage != "step":
            return self.stage
        steps = self._steps_in_flight
        if not steps:
            return "step (between steps)"
        answered = num_replies + (1 if worker is not None and self._collecting and worker.rank in self._answered else 0)
        return f"step {steps[min(answered, len(steps) - 1)].number}"

    async def _initialize(self) -> EngineInfo:
        world = len(self._workers)
        self.stage = "model-load"
        with trio.move_on_after(self.config.model_load_timeout_s) as scope:
            inits: list[ToWorker] = [
                WorkerInit(config=self.config, rank=w.rank, world_size=world, data_parallel=self._data_parallel)
                for w in self._workers
            ]
            loaded = await self._call_all(inits, WorkerLoaded)
            num_blocks = min(w.max_num_kv_blocks for w in loaded)
            self.stage = "kv-cache"
            await self._call_all([InitKVCache(num_blocks=num_blocks)] * world, KVCacheReady)
        if scope.cancelled_caught:
            raise EngineStartupError(
                self._late_message(f"model_load_timeout_s={self.config.model_load_timeout_s}s"),
                stage=self.stage,
                process=", ".join(w.name for w in self._late_workers()),
            )
        self.stage = "step"
        model = loaded[OUTPUT_RANK].model
        block_size = self.config.block_size
        return EngineInfo(
            model=model,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            # A request alone must always fit in the cache, or preemption could loop.
            max_model_len=min(model.max_model_len, num_blocks * block_size),
            engine_pid=os.getpid(),
            worker_pids=[w.pid for w in self._workers if w.pid is not None],
        )

    async def _call_all(self, messages: list[ToWorker], reply_type: type[_Reply]) -> list[_Reply]:
        """Send each worker its message, then take one reply from each."""
        await self._send_all(messages)
        return await self._receive_all(reply_type)

    async def _send_all(self, messages: Sequence[ToWorker]) -> None:
        """Send each worker its message. A worker whose stream is already
        closed (it is exiting) fails as in ``_receive_all``."""
        for worker, msg in zip(self._workers, messages, strict=True):
            assert worker.outbox is not None
            try:
                await worker.outbox.send(msg)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self._fail(worker, "closed its stream")

    async def _receive_all(self, reply_type: type[_Reply]) -> list[_Reply]:
        """Take one reply from each worker, in rank order. A worker that
        reports a failure or closes its stream gets ``EXIT_WAIT_S`` to exit,
        so that the monitor's error (with its exit code) is the one raised.
        If cancelled, replies not yet taken stay in the workers' inboxes
        (``_late_workers`` looks there)."""
        self._answered = set()
        replies: list[_Reply] = []
        for worker in self._workers:
            assert worker.inbox is not None
            try:
                reply = await worker.inbox.receive()
            except trio.EndOfChannel:
                await self._fail(worker, "closed its stream")
            if isinstance(reply, WorkerFailed):
                self._last_words[worker.rank] = reply.message
                await self._fail(worker, f"failed: {reply.message}")
            if not isinstance(reply, reply_type):
                await self._fail(worker, f"sent {type(reply).__name__} where {reply_type.__name__} was expected")
            replies.append(reply)
            self._answered.add(worker.rank)
        return replies

    async def _fail(self, worker: WorkerHandle, what: str) -> NoReturn:
        """Raise for a worker that went wrong in the middle of a call, after
        giving it ``EXIT_WAIT_S`` to exit (then the monitor raises instead)."""
        with trio.move_on_after(EXIT_WAIT_S):
            await worker.exited.wait()
            await trio.sleep_forever()  # the monitor's WorkerError cancels this
        raise self._report(
            WorkerError(
                f"{worker.name} (pid {worker.pid}) {what} during {self._stage_label()}",
                stage=self.stage,
                process=worker.name,
                exit_code=None if worker.process is None else worker.process.returncode,
            )
        )

    def _late_workers(self) -> list[WorkerHandle]:
        """After a call timed out: the workers whose reply has not arrived
        (neither taken by ``_call_all`` nor waiting in their inbox)."""
        return [w for w in self._workers if w.rank not in self._answered and not w.has_reply()]

    def _late_message(self, deadline: str) -> str:
        late = self._late_workers()
        names = " and ".join(f"{w.name} (pid {w.pid})" for w in late) or "the workers"
        return f"{names} did not finish {self._stage_label()} within {deadline}"

    async def dispatch(self, step: Step) -> None:
        """Send ``step`` to every worker. Up to a few steps may be in flight:
        workers run them in order, and ``collect`` takes their outputs in the
        same order."""
        await self._send_all([step.scheduled] * len(self._workers))

    async def collect(self, step: Step) -> RunnerOutput:
        """The output rank's sampled tokens for ``step``, the oldest step in flight.

        The step may run as long as ``core.step_timing`` allows for its size
        (counted from this call: the step before has just been collected, so
        the workers are on this one); past that, the workers that did not
        answer are killed as hung and ``StepTimeout`` names them, the step
        and the deadline. Must not be called concurrently (the step loop is
        its one caller). If cancelled mid-step, workers may still be running
        that step: the engine core is going down anyway, and cancellation
        stops them.
        """
        deadline = self._timing.deadline(step.num_tokens)
        self._collecting = True
        self._collect_started_at = started = trio.current_time()
        try:
            with trio.move_on_after(deadline) as scope:
                replies = await self._receive_all(RunnerOutput)
        finally:
            self._collecting = False
            self._collect_started_at = None
        if scope.cancelled_caught:
            late = self._late_workers()
            self._kill_hung(late)
            raise self._report(
                StepTimeout(
                    self._late_message(self._timing.describe(step.num_tokens)) + ": hung, killed",
                    stage="step",
                    process=", ".join(w.name for w in late),
                )
            )
        self._timing.observe(step.num_tokens, trio.current_time() - started)
        first = replies[OUTPUT_RANK]
        for worker, reply in zip(self._workers, replies, strict=True):
            # Each rank appends what it samples to its own copy of the requests:
            # ranks that disagree would drift apart silently.
            if reply is not first and (reply.req_ids, reply.sampled_token_ids) != (
                first.req_ids,
                first.sampled_token_ids,
            ):
                raise self._report(
                    WorkerError(
                        f"{worker.name} (pid {worker.pid}) sampled other tokens than rank {OUTPUT_RANK} "
                        f"in {self._stage_label()}",
                        stage="step",
                        process=worker.name,
                    )
                )
        return first
