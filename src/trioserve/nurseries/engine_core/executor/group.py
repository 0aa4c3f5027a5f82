"""The workers of one engine core as a group: spawning, supervising, messages to and from all of them, and their
failures, each named.

Each worker is a supervised child process with a private framed stream,
bridged to a pair of memory channels. A call goes to every worker and takes
one reply from each, in rank order. The supervising tasks are the worker
monitor: a worker that exits is noticed the moment it is reaped, and a
``WorkerError`` naming it, the stage (and step) and its exit code or signal
cancels the engine core. The heartbeat watch declares a silent worker hung.
The step a worker was running is named from the step loop's steps in flight,
asked for (``steps_in_flight``), never kept here.

With several ranks (tensor parallelism) the workers form one torch.distributed
group, meeting through a file in a private 0700 directory, and a rank that
fails leaves its peers blocked in a collective that never completes. So the
moment any worker fails (exits, reports a failure, misses a deadline, falls
silent), every other live worker is killed as hung (SIGKILL, no grace): the
group is restarted as one, with its engine core.

The group knows messages, not what they mean: ``executor.Executor``, which
has one, says what the engine core asks of its workers (start-up, steps,
control calls) and moves the group through its stages.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NoReturn, TypeVar

import trio

from trioserve.config import EngineConfig
from trioserve.core.step import Step
from trioserve.errors import EngineStartupError
from trioserve.messages import (
    FromWorker,
    KVCacheReady,
    RpcReply,
    RunnerOutput,
    ToWorker,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLoaded,
)
from trioserve.nurseries.engine_core.executor.handles import ExecutorStage, WorkerError, WorkerHandle, WorkerHung
from trioserve.nurseries.supervision.process import ChildProcess, ProcessExited, python_argv, supervise_process
from trioserve.nurseries.worker.main import WORKER_FD_ENV, WORKER_RANK_ENV
from trioserve.transport.framing import MessageBridge, socketpair_for_child
from trioserve.transport.silence import TICK_MAX_S, sleep_noting_absence

# How long a worker that reported a failure, or closed its stream, gets to
# exit, so that the error can name its exit code. It exits at once after its
# last word; this only bounds a worker that does not.
EXIT_WAIT_S = 0.5
# How long the stream of a worker that exited gets to deliver what it still
# holds (its last words). It ends at once when the worker dies; the bound
# leaves room for an engine core that a busy machine runs late.
LAST_WORDS_WAIT_S = 2.0

_Reply = TypeVar("_Reply", WorkerLoaded, KVCacheReady, RunnerOutput, RpcReply)


class WorkerGroup:
    """The engine core's workers. ``steps_in_flight`` gives the step loop's
    steps sent and not yet collected, oldest first: asked each time a
    failure names the step a worker was running.
    ``on_failure`` is told the reason the moment the workers fail once they
    serve steps, before anything is stopped or reaped, so that the engine
    core can say so at once."""

    def __init__(
        self,
        config: EngineConfig,
        on_failure: Callable[[str], None] | None = None,
        *,
        steps_in_flight: Callable[[], Sequence[Step]],
        engine_index: int = 0,
        private_dir: str | None = None,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self._private_dir = private_dir  # where the ranks' rendezvous file goes (a temporary one if None)
        self._steps_in_flight = steps_in_flight
        self._on_failure = on_failure
        self._reported = False
        self.workers: list[WorkerHandle] = []  # in rank order
        self.stage: ExecutorStage = "spawn"  # then "model-load", "kv-cache", "step": the executor moves it on
        self._collecting = False  # receive_all() is taking the replies of a step
        self._last_words: dict[int, str] = {}  # rank -> its WorkerFailed message
        self._answered: set[int] = set()  # ranks whose reply the current call has taken

    async def start(self, nursery: trio.Nursery) -> None:
        """Spawn every rank in ``nursery``, each with its monitor and its
        stream's bridge, then the heartbeat watch. A worker that cannot be
        spawned raises ``EngineStartupError`` (stage ``spawn``); cancelling
        ``nursery`` stops and reaps them all."""
        for rank in range(self.config.tensor_parallel_size):
            self.workers.append(await self._start_worker(nursery, rank))
        nursery.start_soon(self._watch_heartbeats)

    @contextmanager
    def rendezvous_file(self) -> Iterator[str]:
        """A fresh path where the ranks meet to form their process group (""
        for one worker), in the private directory (or a temporary 0700 one);
        removed, with the temporary directory, on the way out."""
        if self.config.tensor_parallel_size == 1:
            yield ""
            return
        own_dir = tempfile.mkdtemp(prefix="trioserve-tp-") if self._private_dir is None else None
        path = os.path.join(own_dir or self._private_dir or "", f"tp-{self.engine_index}-{secrets.token_hex(4)}")
        try:
            yield path
        finally:
            if own_dir is not None:
                shutil.rmtree(own_dir, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # --- failures ---------------------------------------------------------------

    def report(self, error: WorkerError) -> WorkerError:
        """Tell ``on_failure`` (once, and only once steps are served), and
        stop the rest of the group at once; return ``error``."""
        if self.stage == "step" and not self._reported and self._on_failure is not None:
            self._reported = True
            self._on_failure(str(error))
        self.stop_group()
        return error

    def stop_group(self) -> None:
        """With several ranks, kill every live worker as hung (SIGKILL now, no
        grace): a rank's peers may be blocked in a collective that waits for
        it forever, where a polite stop would only wait out the grace."""
        if len(self.workers) > 1:
            self.kill_hung(self.workers)

    async def _watch_heartbeats(self) -> None:
        """Declare hung a worker silent for ``heartbeat_timeout_s`` (before it
        was first heard from: ``startup_timeout_s``, which covers its start).
        Time this process itself did not run is not a worker's silence."""
        while True:
            away = await sleep_noting_absence(min(self.config.heartbeat_interval_s / 2, TICK_MAX_S))
            for worker in self.workers:
                worker.silence.excuse(away)
                limit = self.config.heartbeat_timeout_s if worker.heard else self.config.startup_timeout_s
                if worker.silent_for() > limit and worker.process is not None and worker.process.returncode is None:
                    self.kill_hung([worker])
                    raise self.report(
                        WorkerHung(
                            f"{worker.name} (pid {worker.pid}) sent nothing for {worker.silent_for():.1f}s "
                            f"(heartbeat_timeout_s={limit}s) during {self.stage_label(worker)}: "
                            "hung (stopped, or stuck), killed",
                            stage=self.stage,
                            process=worker.name,
                        )
                    )

    def kill_hung(self, workers: list[WorkerHandle]) -> None:
        for worker in workers:
            if worker.process is not None:
                worker.process.declare_hung()

    async def _start_worker(self, nursery: trio.Nursery, rank: int) -> WorkerHandle:
        worker = WorkerHandle(rank)
        parent_end, child_end = socketpair_for_child()
        env = {**os.environ, WORKER_FD_ENV: str(child_end.fileno()), WORKER_RANK_ENV: str(rank)}
        if self.config.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # transformers' sharding picks the accelerator it sees
        argv = python_argv("trioserve.nurseries.supervision.entry", "worker")
        try:
            worker.process = await nursery.start(
                partial(self._monitor, argv, worker, pass_fds=[child_end.fileno()], env=env)
            )
        except OSError as exc:
            await trio.aclose_forcefully(parent_end)
            raise EngineStartupError(f"could not start {worker.name}: {exc}", stage="spawn", process=worker.name)
        finally:
            child_end.close()
        worker.bridge = MessageBridge(
            parent_end,
            receive_type=FromWorker,
            name=worker.name,
            drop=(WorkerHeartbeat,),
            on_receive=partial(self._note_last_words, worker.rank),
        )
        worker.outbox, worker.inbox = await nursery.start(self._bridge, worker.bridge, worker)
        return worker

    def _note_last_words(self, rank: int, msg: FromWorker) -> None:
        """Keep a worker's ``WorkerFailed`` as its stream delivers it, before
        it is queued: the monitor names it even when the collector has taken
        it off the inbox and not yet looked at it (``receive()`` yields after
        taking a message, and a monitor that drained the inbox just then would
        find nothing)."""
        if isinstance(msg, WorkerFailed):
            self._last_words[rank] = msg.message

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
        stream gets ``LAST_WORDS_WAIT_S`` to deliver it). If cancelled, the worker
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
            with trio.move_on_after(LAST_WORDS_WAIT_S):
                await worker.stream_closed.wait()
            num_replies, failure = worker.drain()
            last_words = self._last_words.get(worker.rank) or failure
            stage = self.stage_label(worker, num_replies)
            message = f"{exc} during {stage}" + (f": {last_words}" if last_words else "")
            raise self.report(
                WorkerError(message, stage=self.stage, process=worker.name, exit_code=exc.exit_code)
            ) from None
        finally:
            worker.exited.set()

    def stage_label(self, worker: WorkerHandle | None = None, num_replies: int = 0) -> str:
        """The stage; in the step stage, the step being run: the oldest step
        not yet collected or, for a ``worker`` that already answered some of
        the steps in flight (``num_replies`` still in its inbox, and maybe one
        taken by the collect in progress), the first it has not answered."""
        if self.stage != "step":
            return self.stage
        steps = self._steps_in_flight()
        if not steps:
            return "step (between steps)"
        answered = num_replies + (1 if worker is not None and self._collecting and worker.rank in self._answered else 0)
        return f"step {steps[min(answered, len(steps) - 1)].number}"

    async def call_all(self, messages: list[ToWorker], reply_type: type[_Reply]) -> list[_Reply]:
        """Send each worker its message, then take one reply from each."""
        self._answered = set()  # none yet, even if cancelled while sending: every worker may be named late
        await self.send_all(messages)
        return await self.receive_all(reply_type)

    async def send_all(self, messages: Sequence[ToWorker]) -> None:
        """Send each worker its message. A worker whose stream is already
        closed (it is exiting) fails as in ``receive_all``."""
        for worker, msg in zip(self.workers, messages, strict=True):
            assert worker.outbox is not None
            try:
                await worker.outbox.send(msg)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self._fail(worker, "closed its stream")

    async def receive_all(self, reply_type: type[_Reply], *, collecting: bool = False) -> list[_Reply]:
        """Take one reply from each worker, in rank order; ``collecting``: the
        replies are the oldest step in flight's (a worker that dies meanwhile
        is named at the step after the one whose reply was taken). A worker
        that reports a failure or closes its stream gets ``EXIT_WAIT_S`` to
        exit, so that the monitor's error (with its exit code) is the one
        raised. If cancelled, replies not yet taken stay in the workers'
        inboxes (``late_workers`` looks there)."""
        self._answered = set()
        self._collecting = collecting
        try:
            replies: list[_Reply] = []
            for worker in self.workers:
                assert worker.inbox is not None
                try:
                    reply = await worker.inbox.receive()
                except trio.EndOfChannel:
                    await self._fail(worker, "closed its stream")
                if isinstance(reply, WorkerFailed):
                    await self._fail(worker, f"failed: {reply.message}")
                if not isinstance(reply, reply_type):
                    await self._fail(worker, f"sent {type(reply).__name__} where {reply_type.__name__} was expected")
                replies.append(reply)
                self._answered.add(worker.rank)
            return replies
        finally:
            self._collecting = False

    async def _fail(self, worker: WorkerHandle, what: str) -> NoReturn:
        """Raise for a worker that went wrong in the middle of a call, after
        giving it ``EXIT_WAIT_S`` to exit (then the monitor raises instead)."""
        with trio.move_on_after(EXIT_WAIT_S):
            await worker.exited.wait()
            await trio.sleep_forever()  # the monitor's WorkerError cancels this
        raise self.report(
            WorkerError(
                f"{worker.name} (pid {worker.pid}) {what} during {self.stage_label()}",
                stage=self.stage,
                process=worker.name,
                exit_code=None if worker.process is None else worker.process.returncode,
            )
        )

    def late_workers(self) -> list[WorkerHandle]:
        """After a call timed out: the workers whose reply has not arrived
        (neither taken by ``receive_all`` nor waiting in their inbox)."""
        return [w for w in self.workers if w.rank not in self._answered and not w.has_reply()]

    def late_message(self, deadline: str) -> str:
        late = self.late_workers()
        names = " and ".join(f"{w.name} (pid {w.pid})" for w in late) or "the workers"
        return f"{names} did not finish {self.stage_label()} within {deadline}"
