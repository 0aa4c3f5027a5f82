"""The executor: what the engine core asks of its workers (start-up, steps, control calls), and when it suspects
a hang.

It has a ``group.WorkerGroup`` (spawning, supervising, messages to and from
every worker, stopping the whole group when one rank fails) and moves it
through its stages. The reply that counts comes from the output rank (rank
0); every step, the executor checks that all ranks sampled the same tokens.

Deadlines: spawning and loading are bounded by ``model_load_timeout_s``, each
step by ``step_timeout_s``, each control call by its own deadline. Past one,
the error names the workers that did not answer; cancelling the executor
then stops and reaps them.

The executor keeps no record of steps: the step loop owns the queue of steps
in flight (``core.step.Step``) and hands each to ``dispatch`` and ``collect``;
the executor asks for that queue (``steps_in_flight``, set by whoever runs
the step loop) to name the step a dead worker was running. ``rpc`` runs a
control call on every worker between steps (none in flight: it asks too).
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
    GrammarBitmask,
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
from trioserve.nurseries.engine_core.executor.handles import ExecutorStage, StepTimeout, WorkerError
from trioserve.rpc import WorkerCall

OUTPUT_RANK = 0


def _no_steps() -> Sequence[Step]:
    return ()


class Executor:
    """The engine core's workers. ``on_failure`` is told the reason the
    moment they fail once they serve steps (``WorkerGroup``);
    ``data_parallel``: in lockstep, where the output rank's collective meets;
    ``private_dir``: where the ranks' rendezvous file goes."""

    def __init__(
        self,
        config: EngineConfig,
        on_failure: Callable[[str], None] | None = None,
        *,
        data_parallel: DataParallelInit | None = None,
        engine_index: int = 0,
        local_engine_index: int | None = None,
        private_dir: str | None = None,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        # Its place among the engine cores of its host: its workers' accelerators (gpu/device.py).
        self.local_engine_index = engine_index if local_engine_index is None else local_engine_index
        # The step loop's steps sent and not yet collected, oldest first: asked, never kept (none until set).
        self.steps_in_flight: Callable[[], Sequence[Step]] = _no_steps
        self.group = WorkerGroup(
            config,
            on_failure,
            steps_in_flight=lambda: self.steps_in_flight(),  # noqa: PLW0108 - looked up when asked: set later
            engine_index=engine_index,
            private_dir=private_dir,
        )
        self._data_parallel = data_parallel  # lockstep: where the output rank's collective meets
        self._timing = StepTiming(
            factor=config.step_hang_factor, min_s=config.step_hang_min_s, limit_s=config.step_timeout_s
        )
        self._collecting: tuple[Step, float] | None = None  # the step collect() waits for, and since when

    @property
    def stage(self) -> ExecutorStage:
        """Where the workers are: ``spawn``, ``model-load``, ``kv-cache``, then ``step``."""
        return self.group.stage

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
        with self.group.rendezvous_file() as rendezvous:
            async with trio.open_nursery() as nursery:
                await self.group.start(nursery)
                info = await self._initialize(rendezvous)
                task_status.started(info)
                await trio.sleep_forever()

    def suspicion(self) -> str:
        """Why a hang is suspected now (a worker silent for two heartbeats, a
        step past half its deadline), or ``""``."""
        workers = self.group.workers
        late = [w for w in workers if w.heard and w.silent_for() > 2 * self.config.heartbeat_interval_s]
        if late:
            return "; ".join(f"{w.name} silent for {w.silent_for():.1f}s" for w in late)
        if self._collecting is not None:
            step, started = self._collecting
            running = trio.current_time() - started
            if running > self._timing.deadline(step.num_tokens) / 2:
                return f"step {step.number} has run {running:.1f}s; it may run {self._timing.describe(step.num_tokens)}"
        return ""

    def worker_init(self, rank: int, world_size: int, rendezvous: str) -> WorkerInit:
        """What worker ``rank`` is told first: the config, its place in the
        engine core's group, and the engine core's on this host (its accelerators)."""
        return WorkerInit(
            config=self.config,
            rank=rank,
            world_size=world_size,
            data_parallel=self._data_parallel,
            dist_init_file=rendezvous,
            engine_index=self.engine_index,
            local_engine_index=self.local_engine_index,
        )

    async def _initialize(self, rendezvous: str) -> EngineInfo:
        group = self.group
        world = len(group.workers)
        group.stage = "model-load"
        with trio.move_on_after(self.config.model_load_timeout_s) as scope:
            inits: list[ToWorker] = [self.worker_init(w.rank, world, rendezvous) for w in group.workers]
            loaded = await group.call_all(inits, WorkerLoaded)
            num_blocks = min(w.max_num_kv_blocks for w in loaded)
            group.stage = "kv-cache"
            await group.call_all([InitKVCache(num_blocks=num_blocks)] * world, KVCacheReady)
        if scope.cancelled_caught:
            group.stop_group()  # a late rank's peers may wait in a collective for it
            raise EngineStartupError(
                group.late_message(f"model_load_timeout_s={self.config.model_load_timeout_s}s"),
                stage=group.stage,
                process=", ".join(w.name for w in group.late_workers()),
            )
        group.stage = "step"
        model = loaded[OUTPUT_RANK].model
        block_size = self.config.block_size
        return EngineInfo(
            model=model,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            # A request alone must always fit in the cache, or preemption could loop.
            max_model_len=min(model.max_model_len, num_blocks * block_size),
            engine_pid=os.getpid(),
            worker_pids=[w.pid for w in group.workers if w.pid is not None],
        )

    async def dispatch(self, step: Step) -> None:
        """Send ``step`` to every worker. Up to a few steps may be in flight:
        workers run them in order, and ``collect`` takes their outputs in the
        same order."""
        await self.group.send_all([step.scheduled] * len(self.group.workers))

    async def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        """Send every worker the bitmask of the oldest step in flight (which
        they run up to sampling, then wait for it)."""
        await self.group.send_all([bitmask] * len(self.group.workers))

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
        group = self.group
        deadline = self._timing.deadline(step.num_tokens)
        self._collecting = (step, started := trio.current_time())
        try:
            with trio.move_on_after(deadline) as scope:
                replies = await group.receive_all(RunnerOutput, collecting=True)
        finally:
            self._collecting = None
        if scope.cancelled_caught:
            late = group.late_workers()
            group.kill_hung(late)
            raise group.report(
                StepTimeout(
                    group.late_message(self._timing.describe(step.num_tokens)) + ": hung, killed",
                    stage="step",
                    process=", ".join(w.name for w in late),
                )
            )
        self._timing.observe(step.num_tokens, trio.current_time() - started)
        first = replies[OUTPUT_RANK]
        for worker, reply in zip(group.workers, replies, strict=True):
            # Each rank appends what it samples to its own copy of the requests:
            # ranks that disagree would drift apart silently.
            if reply is not first and (reply.req_ids, reply.sampled_token_ids) != (
                first.req_ids,
                first.sampled_token_ids,
            ):
                raise group.report(
                    WorkerError(
                        f"{worker.name} (pid {worker.pid}) sampled other tokens than rank {OUTPUT_RANK} "
                        f"in {group.stage_label()}",
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
        group = self.group
        if self.steps_in_flight():
            raise RuntimeError("Executor.rpc() with steps in flight")
        with trio.move_on_after(timeout_s) as scope:
            replies = await group.call_all([RpcRequest(call=call)] * len(group.workers), RpcReply)
        if scope.cancelled_caught:
            late = group.late_workers()
            group.kill_hung(late)
            names = " and ".join(f"{w.name} (pid {w.pid})" for w in late)
            raise group.report(
                StepTimeout(
                    f"{names} did not answer {type(call).__name__} within {timeout_s}s: hung, killed",
                    stage="step",
                    process=", ".join(w.name for w in late),
                )
            )
        return replies
