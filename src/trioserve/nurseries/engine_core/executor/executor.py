"""The executor: the engine core's calls to its workers.

Built on ``worker_group.WorkerGroup`` (spawning, supervising, calls to every
worker, stopping the whole group when one rank fails). The reply that
counts comes from the output rank (rank 0); every step, the executor checks
that all ranks sampled the same tokens.

Deadlines: spawning and loading are bounded by ``model_load_timeout_s``, each
step by ``step_timeout_s``, each control call by its own deadline. Past one,
the error names the workers that did not answer; cancelling the executor
then stops and reaps them.

The executor keeps no record of steps: the step loop owns the queue of steps
in flight (``core.step.Step``) and hands each to ``dispatch`` and ``collect``;
the executor reads that queue (never changes it) to name the step a dead
worker was running. ``rpc`` runs a control call on every worker between
steps (none in flight).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import trio

from trioserve.config import EngineConfig
from trioserve.core.step import Step
from trioserve.core.step_timing import StepTiming
from trioserve.errors import EngineStartupError
from trioserve.messages import (
    DataParallelInit,
    EngineInfo,
    InitKVCache,
    KVCacheReady,
    RpcReply,
    RpcRequest,
    RunnerOutput,
    ToWorker,
    WorkerInit,
    WorkerLoaded,
)
from trioserve.nurseries.engine_core.executor.group import WorkerGroup
from trioserve.nurseries.engine_core.executor.handles import StepTimeout, WorkerError
from trioserve.rpc import WorkerCall

OUTPUT_RANK = 0


class Executor(WorkerGroup):
    """The engine core's workers (see ``WorkerGroup`` for the arguments)."""

    def __init__(
        self,
        config: EngineConfig,
        steps_in_flight: Sequence[Step] = (),
        on_failure: Callable[[str], None] | None = None,
        *,
        data_parallel: DataParallelInit | None = None,
        engine_index: int = 0,
        private_dir: str | None = None,
    ) -> None:
        super().__init__(config, steps_in_flight, on_failure, engine_index=engine_index, private_dir=private_dir)
        self._data_parallel = data_parallel  # lockstep: where the output rank's collective meets
        self._timing = StepTiming(
            factor=config.step_hang_factor, min_s=config.step_hang_min_s, limit_s=config.step_timeout_s
        )
        self._collect_started_at: float | None = None  # when the running collect() began

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
        with self._rendezvous_file() as rendezvous:
            async with trio.open_nursery() as nursery:
                for rank in range(self.config.tensor_parallel_size):
                    self._workers.append(await self._start_worker(nursery, rank))
                nursery.start_soon(self._watch_heartbeats)
                info = await self._initialize(rendezvous)
                task_status.started(info)
                await trio.sleep_forever()

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

    async def _initialize(self, rendezvous: str) -> EngineInfo:
        world = len(self._workers)
        self.stage = "model-load"
        with trio.move_on_after(self.config.model_load_timeout_s) as scope:
            inits: list[ToWorker] = [
                WorkerInit(
                    config=self.config,
                    rank=w.rank,
                    world_size=world,
                    data_parallel=self._data_parallel,
                    dist_init_file=rendezvous,
                    engine_index=self.engine_index,
                )
                for w in self._workers
            ]
            loaded = await self._call_all(inits, WorkerLoaded)
            num_blocks = min(w.max_num_kv_blocks for w in loaded)
            self.stage = "kv-cache"
            await self._call_all([InitKVCache(num_blocks=num_blocks)] * world, KVCacheReady)
        if scope.cancelled_caught:
            self._stop_group()  # a late rank's peers may wait in a collective for it
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

    async def rpc(self, call: WorkerCall, timeout_s: float) -> list[RpcReply]:
        """Run ``call`` on every worker, between steps (none may be in flight);
        each rank's reply, in rank order (a call that raised on a rank is a
        reply with ``error``). Workers that do not answer within ``timeout_s``
        are killed as hung and ``StepTimeout`` names them: a call may wait in
        a collective. If cancelled, the engine core is going down: the
        replies not yet taken are dropped with the workers."""
        if self._steps_in_flight:
            raise RuntimeError("Executor.rpc() with steps in flight")
        with trio.move_on_after(timeout_s) as scope:
            replies = await self._call_all([RpcRequest(call=call)] * len(self._workers), RpcReply)
        if scope.cancelled_caught:
            late = self._late_workers()
            self._kill_hung(late)
            names = " and ".join(f"{w.name} (pid {w.pid})" for w in late)
            raise self._report(
                StepTimeout(
                    f"{names} did not answer {type(call).__name__} within {timeout_s}s: hung, killed",
                    stage="step",
                    process=", ".join(w.name for w in late),
                )
            )
        return replies
