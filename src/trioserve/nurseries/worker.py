"""A worker process: one model runner behind a framed message stream.

The engine core starts it with ``python -m trioserve.nurseries.entry worker``; the
stream's socket arrives as an inherited fd (``TRIOSERVE_WORKER_FD``). The
worker answers, in order: ``WorkerInit`` -> ``WorkerLoaded``, ``InitKVCache``
-> ``KVCacheReady``, then one ``RunnerOutput`` for each ``SchedulerOutput``.
Model code runs in a thread so that this process's trio loop stays free to
notice that its parent is gone, even in the middle of a long step.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.messages import (
    InitKVCache,
    KVCacheReady,
    SchedulerOutput,
    ToWorker,
    WorkerFailed,
    WorkerInit,
)
from trioserve.nurseries.framing import MessageBridge, stream_from_fd

WORKER_FD_ENV = "TRIOSERVE_WORKER_FD"
LAST_WORD_S = 1.0  # how long a failing worker waits for its WorkerFailed to be written


def make_runner(config: EngineConfig, rank: int, world_size: int) -> Any:
    """The runner the config asks for. The transformers runner's imports
    (torch and all) happen here, so call this off the trio thread."""
    if config.runner == "fake":
        from trioserve.nurseries.fake_runner import FakeRunner

        return FakeRunner(config, rank, world_size)
    from trioserve.gpu.model_runner import ModelRunner

    return ModelRunner(config, rank, world_size)


async def _in_thread(fn: Any, *args: Any) -> Any:
    # If cancelled (parent gone), the thread is abandoned and the process exits
    # without waiting for the model step to finish.
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def _expect(inbox: trio.MemoryReceiveChannel[Any], kind: type) -> Any:
    msg = await inbox.receive()
    if not isinstance(msg, kind):
        raise RuntimeError(f"worker expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def serve(outbox: trio.MemorySendChannel[Any], inbox: trio.MemoryReceiveChannel[Any]) -> None:
    """Answer the engine core until it closes the stream."""
    stage = "model-load"
    try:
        init: WorkerInit = await _expect(inbox, WorkerInit)
        runner = await _in_thread(make_runner, init.config, init.rank, init.world_size)
        await outbox.send(await _in_thread(runner.load))
        stage = "kv-cache"
        kv: InitKVCache = await _expect(inbox, InitKVCache)
        await _in_thread(runner.init_kv_cache, kv.num_blocks)
        await outbox.send(KVCacheReady())
        stage = "step"
        async for msg in inbox:
            if not isinstance(msg, SchedulerOutput):
                raise RuntimeError(f"worker expected SchedulerOutput, got {type(msg).__name__}")
            await outbox.send(await _in_thread(runner.execute, msg))
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(exc)).strip()
        with trio.move_on_after(1) as scope:
            scope.shield = True
            await outbox.send(WorkerFailed(stage=stage, message=detail))
        raise


async def worker_main() -> None:
    stream = stream_from_fd(int(os.environ[WORKER_FD_ENV]))
    bridge = MessageBridge(stream, receive_type=ToWorker, name=f"worker-{os.getpid()}")
    async with trio.open_nursery() as nursery:
        outbox, inbox = await nursery.start(bridge.run)
        try:
            await serve(outbox, inbox)
        except Exception:
            # Let the bridge write the last word (WorkerFailed) before the
            # failure cancels it.
            outbox.close()
            with trio.move_on_after(LAST_WORD_S):
                await bridge.writer_done.wait()
            raise
        nursery.cancel_scope.cancel()
