"""A worker process: one model runner behind a framed message stream.

The engine core starts it with ``python -m trioserve.nurseries.supervision.entry worker``; the
stream's socket arrives as an inherited fd (``TRIOSERVE_WORKER_FD``). The
worker answers, in order: ``WorkerInit`` -> ``WorkerLoaded``, ``InitKVCache``
-> ``KVCacheReady``, then one ``RunnerOutput`` for each ``SchedulerOutput``
(after a ``GrammarBitmask`` too, for a step that ``awaits_bitmask``: it is
read once the step's forward pass is done, just before sampling) and one
``RpcReply`` for each ``RpcRequest`` (a control call between steps),
until the engine core closes the stream. A control call that raises is
answered with its error, and the worker serves on; a step that raises ends
the worker. From ``WorkerInit`` on, a thread of
its own also sends ``WorkerHeartbeat`` every ``heartbeat_interval_s``, so the
engine core tells a busy worker from a stopped one.

The whole conversation runs in one thread with blocking reads and writes on
the socket (``BlockingFrames``): a step's reply goes out, and the next step
is read, without handing anything between threads. (Relaying each step
through Trio tasks and a thread hand-off cost about 1 ms between steps; see
docs/architecture.md.) The Trio loop in the main thread stays free to notice
that the parent is gone, even in the middle of a long step: then the thread
is abandoned and the process exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import traceback
from typing import Any, Protocol

import msgspec
import trio

from trioserve.messages import (
    GrammarBitmask,
    InitKVCache,
    KVCacheReady,
    RpcReply,
    RpcRequest,
    SchedulerOutput,
    ToWorker,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerInit,
    WorkerStage,
)
from trioserve.nurseries.supervision.child_main import ChildFailed
from trioserve.rpc import (
    DescribeShard,
    DropAdapter,
    Echo,
    EchoReply,
    LoadAdapter,
    LoraInfo,
    PinAdapter,
    ProfileShard,
    SleepShard,
    TraceFile,
    WakeShard,
    WorkerCall,
    WorkerResult,
)
from trioserve.runners import Runner
from trioserve.runners.trace import worker_trace_path
from trioserve.transport.framing import BlockingFrames, socket_from_fd

WORKER_FD_ENV = "TRIOSERVE_WORKER_FD"
WORKER_RANK_ENV = "TRIOSERVE_WORKER_RANK"  # for people and tools: the rank arrives in WorkerInit
LAST_WORD_S = 1.0  # how long a failing worker waits for its WorkerFailed to be written

log = logging.getLogger("trioserve.worker")


def make_runner(init: WorkerInit) -> Runner:
    """The runner ``init.config.runner`` names. The transformers runner's
    imports (torch and all) happen here, so call this off the Trio thread."""
    if init.config.runner == "fake":
        from trioserve.runners.fake import FakeRunner

        return FakeRunner(init.config, init.rank, init.world_size, engine_index=init.engine_index)
    from trioserve.gpu.model_runner import ModelRunner

    return ModelRunner(
        init.config,
        init.rank,
        init.world_size,
        dist_init_file=init.dist_init_file,
        engine_index=init.engine_index,
        local_engine_index=init.local_engine_index,
    )


class EchoFailure(RuntimeError):
    """``Echo(fail_on_rank=r)`` on rank r: a control call that fails on purpose."""


def run_call(runner: Runner, call: WorkerCall, rank: int) -> WorkerResult:
    """Run one control call on this worker's runner (between steps)."""
    match call:
        case DescribeShard():
            return runner.describe()
        case SleepShard(level=level):
            runner.sleep(level)
            return runner.describe()
        case WakeShard():
            runner.wake_up()
            return runner.describe()
        case Echo(text=text, fail_on_rank=fail_on_rank):
            if fail_on_rank == rank:
                raise EchoFailure(f"echo: rank {rank} fails, as asked (fail_on_rank={fail_on_rank})")
            return EchoReply(rank=rank, pid=os.getpid(), text=text)
        case LoadAdapter(name=name, path=path):
            return LoraInfo(name=name, path=path, rank=runner.load_adapter(name, path))
        case DropAdapter(name=name):
            runner.drop_adapter(name)
            return LoraInfo(name=name, path="", rank=0)
        case PinAdapter(name=name):
            runner.pin_adapter(name)
            return LoraInfo(name=name, path="", rank=0, pinned=True)
        case ProfileShard(start=True):
            runner.start_profile()
            return TraceFile(path="", rank=rank)
        case ProfileShard(trace_prefix=prefix):  # no prefix: the recording is dropped
            path = worker_trace_path(prefix, rank) if prefix else ""
            runner.stop_profile(path)
            return TraceFile(path=path, rank=rank)


def answer_call(runner: Runner, request: RpcRequest, rank: int) -> RpcReply:
    """``RpcReply`` with the call's result, or with what it raised (logged here)."""
    try:
        return RpcReply(result=run_call(runner, request.call, rank))
    except Exception as exc:
        log.warning("control call %s failed: %s", type(request.call).__name__, exc)
        return RpcReply(error="".join(traceback.format_exception_only(exc)).strip())


class _Conversation:
    """The worker's side of the stream, in blocking calls: one thread reads
    and answers; the heartbeat thread writes too, so writes take a lock (a
    frame is never interleaved with another)."""

    def __init__(self, sock: socket.socket) -> None:
        self.frames = BlockingFrames(sock)
        self._decode = msgspec.msgpack.Decoder(ToWorker).decode
        self._encode = msgspec.msgpack.Encoder().encode
        self._write_lock = threading.Lock()

    def receive(self) -> Any:
        """The next message, or ``None`` once the engine core closed the stream."""
        payload = self.frames.read()
        return None if payload is None else self._decode(payload)

    def expect(self, kind: type) -> Any:
        msg = self.receive()
        if not isinstance(msg, kind):
            got = "the end of the stream" if msg is None else type(msg).__name__
            raise RuntimeError(f"worker expected {kind.__name__}, got {got}")
        return msg

    def send(self, msg: msgspec.Struct) -> None:
        payload = self._encode(msg)
        with self._write_lock:
            self.frames.write(payload)

    def start_heartbeats(self, interval_s: float) -> threading.Event:
        """Send ``WorkerHeartbeat`` every ``interval_s`` from a daemon thread
        until the returned event is set or the stream breaks. It runs whatever
        the model does (torch releases the GIL in its kernels; Python code
        yields it every few milliseconds), so only a stopped or wedged process
        falls silent."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval_s):
                try:
                    self.send(WorkerHeartbeat())
                except OSError:
                    return  # the engine core is gone: the parent watch ends this process

        threading.Thread(target=beat, name="worker-heartbeat", daemon=True).start()
        return stop


class AnyOf(Protocol):
    """A data-parallel collective: the OR of every engine's flag, once per step."""

    def any_of(self, flag: bool) -> bool: ...


def make_dp_collective(init: WorkerInit) -> AnyOf | None:
    """The collective this worker joins every lockstep step: only the output
    rank (0) of each engine core joins; the transformers runner's is gloo
    (torch), the fake runner's a ZeroMQ barrier. None out of lockstep."""
    dp = init.data_parallel
    if dp is None or init.rank != 0:
        return None
    if init.config.runner == "fake":
        from trioserve.transport.barrier import ZmqAnyOf

        return ZmqAnyOf(f"ipc://{dp.rendezvous}", dp.rank, dp.size)
    from trioserve.gpu.dp_collective import GlooAnyOf

    return GlooAnyOf(f"{dp.rendezvous}.store", dp.rank, dp.size)


def serve(sock: socket.socket) -> None:
    """Answer the engine core until it closes the stream (blocking: run it in
    a thread). On a failure, report ``WorkerFailed`` naming the stage, then
    raise."""
    talk = _Conversation(sock)
    stage: WorkerStage = "model-load"
    heartbeats = None
    try:
        init: WorkerInit = talk.expect(WorkerInit)
        heartbeats = talk.start_heartbeats(init.config.heartbeat_interval_s)
        runner = make_runner(init)
        collective = make_dp_collective(init)
        talk.send(runner.load())
        stage = "kv-cache"
        kv: InitKVCache = talk.expect(InitKVCache)
        runner.init_kv_cache(kv.num_blocks)
        talk.send(KVCacheReady())
        stage = "step"
        while (msg := talk.receive()) is not None:
            if isinstance(msg, SchedulerOutput):
                step_output = runner.execute(msg, bitmask=lambda: talk.expect(GrammarBitmask))
                if msg.dp_unfinished is not None and collective is not None:
                    step_output.dp_any_unfinished = collective.any_of(msg.dp_unfinished)
                output: msgspec.Struct = step_output
            elif isinstance(msg, RpcRequest):
                output = answer_call(runner, msg, init.rank)
            else:
                raise RuntimeError(f"worker expected SchedulerOutput or RpcRequest, got {type(msg).__name__}")
            try:
                talk.send(output)
            except (BrokenPipeError, ConnectionResetError):
                log.debug("the engine core closed the stream during a step")
                return  # it is going down: same as the end of the stream
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(exc)).strip()
        try:
            sock.settimeout(LAST_WORD_S)
            talk.send(WorkerFailed(stage=stage, message=detail))
        except OSError as write_error:  # the engine core is gone or not reading
            log.debug("could not report the failure: %s", write_error)
        raise
    finally:
        if heartbeats is not None:
            heartbeats.set()


async def worker_main() -> None:
    sock = socket_from_fd(int(os.environ[WORKER_FD_ENV]))
    try:
        # If cancelled (the parent is gone), the thread is abandoned and the
        # process exits without waiting for the model step to finish.
        await trio.to_thread.run_sync(serve, sock, abandon_on_cancel=True)
    except Exception as exc:  # serve() reported it to the engine core: one line here, no traceback
        raise ChildFailed("".join(traceback.format_exception_only(exc)).strip()) from exc
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes an abandoned thread blocked on it
        sock.close()
