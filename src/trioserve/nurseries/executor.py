"""The executor: the engine core's handle on its worker processes.

Each worker is a supervised child process with a private framed stream,
bridged to a pair of memory channels. A call goes to every worker; the reply
that counts comes from the output rank (rank 0). The supervising tasks are
the worker monitor: a worker that exits is noticed the moment it is reaped,
and its ``ProcessExited`` cancels the engine core.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineStartupError
from trioserve.messages import (
    FromWorker,
    InitKVCache,
    KVCacheReady,
    RunnerOutput,
    SchedulerOutput,
    WorkerFailed,
    WorkerInit,
    WorkerLoaded,
)
from trioserve.nurseries.framing import MessageBridge, socketpair_for_child
from trioserve.nurseries.process import ChildProcess, supervise_process
from trioserve.nurseries.worker import WORKER_FD_ENV

OUTPUT_RANK = 0


class WorkerError(RuntimeError):
    """A worker reported a failure, or its stream ended, in the middle of a call."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class ExecutorInfo:
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    worker_pids: list[int]


@dataclass
class _Worker:
    rank: int
    process: ChildProcess
    outbox: trio.MemorySendChannel[Any]
    inbox: trio.MemoryReceiveChannel[Any]


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._workers: list[_Worker] = []

    async def run(self, *, task_status: trio.TaskStatus[ExecutorInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers, load the model, size the KV cache, then supervise.

        Reports ``ExecutorInfo`` once every worker is ready. Start-up waits are
        bounded by ``startup_timeout_s`` (spawn) and ``model_load_timeout_s``
        (model and KV cache); past them ``EngineStartupError`` names the stage.
        If cancelled, every worker is asked to stop, then terminated, then
        killed, and always reaped.
        """
        async with trio.open_nursery() as nursery:
            for rank in range(self.config.tensor_parallel_size):
                self._workers.append(await self._start_worker(nursery, rank))
            info = await self._initialize()
            task_status.started(info)
            await trio.sleep_forever()

    async def _start_worker(self, nursery: trio.Nursery, rank: int) -> _Worker:
        parent_end, child_end = socketpair_for_child()
        env = {**os.environ, WORKER_FD_ENV: str(child_end.fileno())}
        argv = [sys.executable, "-m", "trioserve.nurseries.entry", "worker"]
        try:
            process = await nursery.start(
                partial(
                    supervise_process,
                    argv,
                    name=f"worker-{rank}",
                    pass_fds=[child_end.fileno()],
                    env=env,
                    grace_s=self.config.shutdown_grace_s,
                )
            )
        finally:
            child_end.close()
        bridge = MessageBridge(parent_end, receive_type=FromWorker, name=f"worker-{rank}")
        outbox, inbox = await nursery.start(bridge.run)
        return _Worker(rank, process, outbox, inbox)

    async def _initialize(self) -> ExecutorInfo:
        world = len(self._workers)
        stage = "model-load"
        with trio.move_on_after(self.config.model_load_timeout_s) as scope:
            loaded: list[WorkerLoaded] = await self._call_all(
                [WorkerInit(config=self.config, rank=w.rank, world_size=world) for w in self._workers],
                WorkerLoaded,
                stage,
            )
            num_blocks = min(w.max_num_kv_blocks for w in loaded)
            stage = "kv-cache"
            await self._call_all([InitKVCache(num_blocks=num_blocks)] * world, KVCacheReady, stage)
        if scope.cancelled_caught:
            raise EngineStartupError(
                f"workers did not finish {stage} within model_load_timeout_s="
                f"{self.config.model_load_timeout_s}s",
                stage=stage,
                process="worker",
            )
        first = loaded[OUTPUT_RANK]
        return ExecutorInfo(
            num_kv_blocks=num_blocks,
            max_model_len=first.max_model_len,
            vocab_size=first.vocab_size,
            eos_token_ids=first.eos_token_ids,
            worker_pids=[w.process.pid for w in self._workers],
        )

    async def _call_all(self, messages: list[Any], reply_type: type, stage: str) -> list[Any]:
        for worker, msg in zip(self._workers, messages):
            await worker.outbox.send(msg)
        replies = []
        for worker in self._workers:
            try:
                reply = await worker.inbox.receive()
            except trio.EndOfChannel:
                raise WorkerError(f"worker-{worker.rank}: stream closed during {stage}", stage=stage) from None
            if isinstance(reply, WorkerFailed):
                raise WorkerError(f"worker-{worker.rank} failed during {reply.stage}: {reply.message}", stage=reply.stage)
            if not isinstance(reply, reply_type):
                raise WorkerError(
                    f"worker-{worker.rank}: expected {reply_type.__name__}, got {type(reply).__name__}", stage=stage
                )
            replies.append(reply)
        return replies

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step on every worker; the output rank's sampled tokens.

        Must not be called concurrently (the step loop is its one caller). If
        cancelled mid-step, workers may still be running that step: the engine
        core is going down anyway, and cancellation stops them.
        """
        replies = await self._call_all([scheduler_output] * len(self._workers), RunnerOutput, "step")
        return replies[OUTPUT_RANK]
