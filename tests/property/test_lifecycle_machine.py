"""The engine's life cycle under random faults: a hypothesis state machine
over a real engine (the fake runner in real processes, real sockets), with
one engine core or two side by side (data parallel), each supervised on its
own.

The engine runs in a background thread's ``trio.run`` (``EngineHarness``),
which holds the engine, a nursery of request consumers, and every piece of
the machine's model; rules and invariants call into it with
``trio.from_thread.run``, so that the model is only ever touched from the
Trio thread.

Rules: start one engine core or two and submit a first few requests, submit
requests (each read by a consumer task that records every output and its
terminal event; some cancel themselves after k tokens, 0 meaning right after
submission), cancel a running request, stall a consumer (it stops reading
for a while, then resumes or cancels the request), inject a fault into one
engine (kill -9 one of its workers, kill -9 its engine
core, or SIGUSR1 to one of its workers so that its next step raises, see
``FakeRunner``), let time pass, wait for the requests to finish, shut down
(exit ``open_engine``; a new engine then starts for the rest of the run).

The model of outcomes: no request is lost. Most examples run with requests
resumed after their engine core dies (the default): then every request
finishes, with exactly the fake runner's tokens (none repeated, none
skipped, however often it was resumed and wherever), or is cancelled if it
was cancelled, or ends with ``EngineDeadError`` for the one reason the
documentation gives here: it was resumed ``max_resumes`` times already,
which only a request that lived through more deaths than that can be. The
other examples run without resumption (``resume_requests=False``): a
request in flight on an engine core at a fault of its engine (or sent to an
engine core with a SIGUSR1 pending) finishes or raises ``EngineDeadError``;
if it was in flight on the engine core that died, within ``DEATH_BOUND_S``
of the death (of its consumer resuming, if stalled). Either way a fault is
one engine's: requests on the other engine never notice it, they finish as
if nothing happened. Each engine's supervisor restarts its engine core after
each death (the restart budget is never reached here), so a request
submitted after a death was noticed goes to another engine, or waits for the
new engine core, and finishes.

Checked after every step and at teardown: every request gets exactly one
terminal event, and none hangs; the live trioserve processes are exactly
every engine's current ones (no orphan, no zombie); at each engine, the
front-end holds, and the engine core runs or queues, no more requests than
have not ended there, and with none running every KV block is free (so,
once idle: nothing at all); each engine's number of restarts equals the
number of its engine core's deaths, and an engine core dies only of a fault
injected into its own engine. At every shutdown: it finishes within its
bound, every request has ended once, no process remains, and no file
descriptor leaked.

The examples are derandomized (the same on every run) and nothing is
written to a ``.hypothesis`` database.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil
import pytest
import trio
import zmq
from helpers.fakes import EOS, VOCAB, fake_tokens
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import trioserve
from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.errors import EngineDeadError, RequestError
from trioserve.frontend.engines.supervisor import EngineSupervisor
from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.transport.zmq_trio import zmq_context

NUM_KV_BLOCKS = 32
BLOCK_SIZE = 4  # 128 token slots: a few concurrent requests preempt each other
SHUTDOWN_GRACE_S = 0.5

DEATH_BOUND_S = 1.0  # without resumption, a request in flight when its engine dies ends within this
MAX_RESUMES = 2  # the default: a request may be resumed this often, then ends with EngineDeadError
ORPHAN_BOUND_S = 2.0  # a process of a dead (or stopped) engine is gone within this
# Bounds about time that are not the are generous: the machine may be loaded (2 cores, other tests).
HANG_BOUND_S = 45.0  # any request ends within this of its submission, stalls not counted
RESTART_BOUND_S = 30.0  # a dead engine is ready again within this
SHUTDOWN_BOUND_S = 2 * SHUTDOWN_GRACE_S + 1.0  # open_engine's exit: at worst a SIGTERM and a SIGKILL away
START_BOUND_S = 90.0
CALL_BOUND_S = 120.0  # any one call into the Trio thread (a rule's or invariant's work)
MIN_REQUESTS_BEFORE_SHUTDOWN = 4  # a shutdown ends an engine's life: let it see some traffic first

T = TypeVar("T")

# One to three requests: (prompt, max_tokens, cancel_after).
REQUEST_SPECS = st.lists(
    st.tuples(
        st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=8),
        st.sampled_from([1, 5, 30, 120, 1000]),
        st.sampled_from([None, None, 0, 1, 8, 40]),
    ),
    min_size=1,
    max_size=3,
)


def engine_config(model: str, tensor_parallel_size: int, data_parallel_size: int, resume: bool) -> EngineConfig:
    return EngineConfig(
        model=model,
        runner="fake",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        shutdown_grace_s=SHUTDOWN_GRACE_S,
        startup_timeout_s=30.0,
        model_load_timeout_s=30.0,
        step_timeout_s=30.0,
        heartbeat_timeout_s=30.0,  # no hang here: only the faults injected kill an engine core
        max_restarts=1000,  # never out of restarts here (tests/test_supervision.py covers the budget)
        restart_window_s=300.0,
        restart_backoff_s=0.02,
        restart_backoff_max_s=0.1,
        restart_wait_s=RESTART_BOUND_S,
        resume_requests=resume,
        max_resumes=MAX_RESUMES,
        fake=FakeRunnerConfig(eos_token_id=EOS, num_kv_blocks=NUM_KV_BLOCKS, step_delay_s=0.004),
    )


def now() -> float:
    return time.monotonic()


def fd_table() -> dict[int, str]:
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own fd, closed already
    return table


def trioserve_processes() -> list[psutil.Process]:
    """This process's descendants that run ``trioserve.nurseries.supervision.entry``, zombies included."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "trioserve.nurseries.supervision.entry" in proc.cmdline():
                found.append(proc)
        except psutil.ZombieProcess:
            found.append(proc)  # a zombie has no command line, and is ours
        except psutil.Error:
            pass  # gone meanwhile
    return found


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def still_there(proc: psutil.Process) -> bool:
    """Running, or a zombie that this process (or a descendant) has not reaped.
    A zombie under another parent (an orphan's, reparented) is that parent's
    to reap, and counts as gone."""
    try:
        if not proc.is_running():
            return False
        if proc.status() != psutil.STATUS_ZOMBIE:
            return True
        ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
        return proc.ppid() in ours
    except psutil.Error:
        return False


def supervisors(engine: trioserve.Engine) -> list[EngineSupervisor]:
    """The engine's supervisors, one per engine core, by engine index: the
    public API has no per-engine restart count nor requests held."""
    return engine._group.supervisors


# --- the model of one request ------------------------------------------------


@dataclass(eq=False)
class Req:
    """One request and everything its consumer saw."""

    n: int
    prompt: list[int]
    max_tokens: int
    submitted_at: float
    resume: bool  # resumed after its engine core dies (the engine's resume_requests)
    cancel_after: int | None = None  # its consumer cancels it after reading this many tokens
    expected_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    terminals: list[tuple[str, float, str]] = field(default_factory=list)  # (kind, when, detail)
    problems: list[str] = field(default_factory=list)
    entered_at: float | None = None  # submitted to an engine core (the stream's block entered)
    entered_pid: int | None = None  # ...to this one
    engine_index: int | None = None  # ...of this engine
    # Engine cores whose fault may end it if it went to them: one died while it was in flight there, or
    # before it got in (it may have been handed to it just before), or had a SIGUSR1 pending meanwhile.
    risky_pids: set[int] = field(default_factory=set)
    death_deadline: float = math.inf  # in flight at a death: must end by then
    deaths: set[int] = field(default_factory=set)  # resumption on: engine cores that died while it was in flight
    stream: trioserve.RequestStream | None = None
    pending_death: bool = False  # in flight at a death while stalled: the deadline starts when it resumes
    cancel_requested: bool = False
    stall_request: tuple[float, str] | None = None
    stalled_since: float | None = None
    stall_total: float = 0.0
    task_done: bool = False
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    read_scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        where = "" if self.engine_index is None else f" on engine {self.engine_index} (pid {self.entered_pid})"
        return f"<request {self.n}{where}>"

    @property
    def now_on(self) -> int | None:
        """The engine it is on now (resumed elsewhere, perhaps), or None before it got in."""
        return None if self.stream is None else self.stream.engine_index

    @property
    def exposed(self) -> bool:
        """A fault may end it: one of the engine core it went to, or (if it
        never got in) of one it may have been about to go to."""
        if self.entered_pid is None:
            return bool(self.risky_pids)
        return self.entered_pid in self.risky_pids

    @property
    def over(self) -> bool:
        return bool(self.terminals)

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def terminal(self, kind: str, detail: str = "") -> None:
        self.terminals.append((kind, now(), detail))

    def on_output(self, out: RequestOutput) -> None:
        if self.over:
            self.problems.append(f"an output after its terminal event {self.terminals[0][0]}: {out!r}")
        self.token_ids.extend(out.token_ids)
        if out.finish_reason is not None:
            self.finish_reasons.append(out.finish_reason)
            self.terminal("finished", out.finish_reason)

    def active_time(self, at: float) -> float:
        stalled = self.stall_total + (at - self.stalled_since if self.stalled_since is not None else 0.0)
        return at - self.submitted_at - stalled

    def death(self, at: float, engine_pid: int) -> None:
        """The engine core ``engine_pid`` died (or is being killed) at ``at``."""
        if self.over:
            return
        if self.resume:
            self.deaths.add(engine_pid)  # it may have been on it (resumed there, or handed to it just before)
            return
        if self.entered_pid is None:
            self.risky_pids.add(engine_pid)  # it may have been handed to that engine core just before it died
            return
        if self.entered_pid != engine_pid:
            return  # in flight on another engine's engine core, or a later one of this engine
        self.risky_pids.add(engine_pid)
        if self.stalled:
            self.pending_death = True
        else:
            self.death_deadline = min(self.death_deadline, at + DEATH_BOUND_S)

    def violations(self) -> list[str]:
        """What is wrong with what its consumer saw so far."""
        found = [f"{self!r}: {p}" for p in self.problems]
        if len(self.terminals) > 1:
            found.append(f"{self!r}: {len(self.terminals)} terminal events: {self.terminals}")
        if self.token_ids != fake_tokens(self.prompt, len(self.token_ids)):
            found.append(f"{self!r}: tokens {self.token_ids} are not the fake runner's for prompt {self.prompt}")
        if not self.terminals:
            return found
        kind, when, detail = self.terminals[0]
        if kind == "finished":
            if len(self.token_ids) != self.expected_len or detail != "length":
                found.append(
                    f"{self!r}: finished ({detail}) with {len(self.token_ids)} tokens, "
                    f"expected {self.expected_len} (length)"
                )
        elif kind == "dead" and self.resume:
            if len(self.deaths) <= MAX_RESUMES or f"(max_resumes={MAX_RESUMES}): not again" not in detail:
                found.append(
                    f"{self!r}: lost: EngineDeadError after {len(self.deaths)} death(s) of engine cores in its life, "
                    f"resumption on (max_resumes={MAX_RESUMES}): {detail}"
                )
        elif kind == "dead":
            if not self.exposed:
                found.append(f"{self!r}: EngineDeadError although no fault touched its engine core: {detail}")
        elif kind != "cancelled":
            found.append(f"{self!r}: ended with {kind}: {detail}")
        if when > self.death_deadline + 0.05:  # 50 ms for the consumer's own bookkeeping
            found.append(
                f"{self!r}: ended ({kind}) {when - self.death_deadline + DEATH_BOUND_S:.2f}s after its engine died "
                f"(bound {DEATH_BOUND_S}s)"
            )
        return found


@dataclass
class Generation:
    """One engine core's life: its processes, as ``engine.info`` named them when it became ready."""

    engine_pid: int
    worker_pids: list[int]
    procs: dict[int, psutil.Process]
    died_at: float | None = None


# --- the Trio side -----------------------------------------------------------


class EngineHarness:
    """``open_engine`` in a background thread's ``trio.run``, holding a nursery
    of consumers; ``call`` runs an async function there."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: trioserve.Engine | None = None
        self.consumers: trio.Nursery | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None
        self.stopped_at: float | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="engine-harness", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(START_BOUND_S):
            raise AssertionError(f"open_engine did not start within {START_BOUND_S}s")
        if self.error is not None:
            raise AssertionError(f"open_engine failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start() or stop()
            self.error = exc
        finally:
            self.stopped_at = now()
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trioserve.open_engine(config=self.config) as engine:
            async with trio.open_nursery() as consumers:
                self.engine, self.consumers = engine, consumers
                self._ready.set()
                await self._stop.wait()
                consumers.cancel_scope.cancel()  # a shutdown cancels the requests still running

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def bounded() -> T:
            with trio.fail_after(CALL_BOUND_S):
                return await fn(*args)

        return trio.from_thread.run(bounded, trio_token=self.token)

    def stop(self) -> float:
        """Shut the engine down (cancelling its consumers); how long it took.
        Raises if it did not finish within ``SHUTDOWN_BOUND_S`` or failed."""
        started = now()
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(SHUTDOWN_BOUND_S + 5.0)
        if self._thread.is_alive():
            raise AssertionError("shutdown: the engine thread did not finish (open_engine hangs)")
        assert self.stopped_at is not None
        took = self.stopped_at - started
        if self.error is not None:
            raise AssertionError(f"shutdown: open_engine raised {self.error!r}") from self.error
        if took > SHUTDOWN_BOUND_S:
            raise AssertionError(f"shutdown: open_engine took {took:.2f}s to exit (bound {SHUTDOWN_BOUND_S}s)")
        return took


# --- the machine -------------------------------------------------------------


class LifecycleMachine(RuleBasedStateMachine):
    model_dir: str = ""  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.fds_before = fd_table()
        self.harness: EngineHarness | None = None
        self.tensor_parallel_size = 1
        self.data_parallel_size = 1
        self.resume = True
        self.reqs: list[Req] = []
        # Per engine (by engine index): its current engine core (None while restarting), how often its
        # engine core died, whether a SIGUSR1 was sent to one of its workers and its death not yet seen,
        # and how many faults were injected into its current engine core (a death needs one).
        self.gens: list[Generation | None] = [None]
        self.num_deaths = [0]
        self.fault_pending = [False]
        self.num_faults = [0]
        self.unexplained_deaths: list[str] = []  # engine cores that died with no fault of their own
        self.retired: dict[int, psutil.Process] = {}  # processes of dead engine cores
        self.requests_at_last_fault = 0
        self.stopped = False

    # --- plumbing -------------------------------------------------------------

    @property
    def engine(self) -> trioserve.Engine:
        assert self.harness is not None and self.harness.engine is not None
        return self.harness.engine

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        assert self.harness is not None
        return self.harness.call(fn, *args)

    def _open(self) -> None:
        config = engine_config(self.model_dir, self.tensor_parallel_size, self.data_parallel_size, self.resume)
        harness = EngineHarness(config)
        harness.start()
        self.harness = harness
        self.reqs = []
        self.gens = [None] * self.data_parallel_size
        self.num_deaths = [0] * self.data_parallel_size
        self.fault_pending = [False] * self.data_parallel_size
        self.num_faults = [0] * self.data_parallel_size
        self.requests_at_last_fault = 0
        self.call(self._observe_async)

    async def _observe_async(self) -> None:
        self._observe()

    def _observe(self) -> None:
        """(Trio thread) Notice each engine's engine core dying, and a new one's birth."""
        for index in range(self.data_parallel_size):
            self._observe_engine(index)

    def _observe_engine(self, index: int) -> None:
        engine = self.engine
        health, info = engine.engine_healths[index], engine.engine_infos[index]
        at = now()
        gen = self.gens[index]
        if gen is not None and (health != "ready" or info.engine_pid != gen.engine_pid):
            self.gens[index] = None
            gen.died_at = at
            self.retired.update(gen.procs)
            self.num_deaths[index] += 1
            self.fault_pending[index] = False
            if self.num_faults[index] == 0:  # a fault of another engine, say, took it down too
                self.unexplained_deaths.append(f"engine {index}'s engine core (pid {gen.engine_pid})")
            self.num_faults[index] = 0  # (several faults of one engine core: one death)
            for req in self.reqs:
                req.death(at, gen.engine_pid)  # (after a kill: its deadline was set by the kill)
        if self.gens[index] is None and health == "ready":
            procs = {}
            for pid in (info.engine_pid, *info.worker_pids):
                try:
                    procs[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    pass  # died already: noticed next time
            self.gens[index] = Generation(info.engine_pid, list(info.worker_pids), procs)

    async def _wait_ready(self, index: int) -> Generation:
        """(Trio thread) Wait for engine ``index`` to be ready (again, if it
        is restarting); its current engine core."""
        engine = self.engine
        with trio.move_on_after(RESTART_BOUND_S):
            while engine.engine_healths[index] != "ready":
                self._observe()
                await trio.sleep(0.005)
        health = engine.engine_healths[index]
        assert health == "ready", f"engine {index} is {health!r} {RESTART_BOUND_S}s after a death"
        self._observe()
        gen = self.gens[index]
        assert gen is not None
        return gen

    # --- rules ----------------------------------------------------------------

    @initialize(
        tensor_parallel_size=st.sampled_from([1, 2]),
        data_parallel_size=st.sampled_from([1, 2]),
        resume=st.sampled_from([True, True, False]),
        specs=REQUEST_SPECS,
    )
    def start(
        self,
        tensor_parallel_size: int,
        data_parallel_size: int,
        resume: bool,
        specs: list[tuple[list[int], int, int | None]],
    ) -> None:
        """Start an engine of ``data_parallel_size`` engine cores, which
        resumes requests after a death or not, and submit a first few
        requests (so that every example has some, even one whose rules do
        not include ``submit``)."""
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.resume = resume
        self._open()
        self._submit_all(specs)

    @precondition(lambda self: not self.stopped)
    @rule(specs=REQUEST_SPECS)
    def submit(self, specs: list[tuple[list[int], int, int | None]]) -> None:
        """Submit one to three requests (prompt, max_tokens, cancel_after),
        each read by its own consumer; one with ``cancel_after=k`` is
        cancelled by its consumer once it has read ``k`` tokens (0: as soon
        as it is submitted)."""
        self._submit_all(specs)

    def _submit_all(self, specs: list[tuple[list[int], int, int | None]]) -> None:
        for prompt, max_tokens, cancel_after in specs:
            self.call(self._submit, prompt, max_tokens, cancel_after)

    async def _submit(self, prompt: list[int], max_tokens: int, cancel_after: int | None) -> None:
        self._observe()
        req = Req(len(self.reqs), prompt, max_tokens, now(), self.resume, cancel_after=cancel_after)
        for gen, pending in zip(self.gens, self.fault_pending, strict=True):
            if pending and gen is not None:  # if it goes there, the next step may fail it
                req.risky_pids.add(gen.engine_pid)
        self.reqs.append(req)
        assert self.harness is not None and self.harness.consumers is not None
        self.harness.consumers.start_soon(self._consume, req)

    async def _consume(self, req: Req) -> None:
        engine = self.engine
        try:
            with req.cancel_scope:
                try:
                    async with engine.stream(req.prompt, SamplingParams(max_tokens=req.max_tokens)) as stream:
                        assert stream.engine_index is not None
                        req.stream = stream
                        info = engine.engine_infos[stream.engine_index]
                        req.entered_at, req.entered_pid, req.engine_index = now(), info.engine_pid, stream.engine_index
                        req.expected_len = min(req.max_tokens, info.max_model_len - len(req.prompt))
                        await self._read(req, stream)
                except EngineDeadError as exc:
                    req.terminal("dead", str(exc))
                except RequestError as exc:
                    req.terminal("request-error", str(exc))
                except Exception as exc:
                    req.terminal("unexpected", repr(exc))
            if req.cancel_scope.cancelled_caught and not req.over:
                req.terminal("cancelled")
        except trio.Cancelled:  # shutdown
            if not req.over:
                req.terminal("cancelled", "shutdown")
            raise
        finally:
            req.task_done = True

    async def _read(self, req: Req, stream: trioserve.RequestStream) -> None:
        """Read every output (iteration must end by itself after the finished
        one), stalling when asked to."""
        while True:
            if req.cancel_after is not None and len(req.token_ids) >= req.cancel_after:
                req.cancel_requested = True
                req.cancel_scope.cancel()
                await trio.lowlevel.checkpoint()
            if req.stall_request is not None:
                await self._stall_now(req)
            out = None
            with trio.CancelScope() as req.read_scope:  # a stall cancels the read: nothing is lost
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    if not req.over:
                        req.problems.append("the stream ended without a finished output or an error")
                    return
                finally:
                    req.read_scope = None
            if out is not None:
                req.on_output(out)

    async def _stall_now(self, req: Req) -> None:
        assert req.stall_request is not None
        duration, then = req.stall_request
        req.stall_request = None
        req.stalled_since = now()
        await trio.sleep(duration)
        req.stall_total += now() - req.stalled_since
        req.stalled_since = None
        if req.pending_death:  # its engine died while it slept: it must end soon after it resumes
            req.pending_death = False
            req.death_deadline = min(req.death_deadline, now() + DEATH_BOUND_S)
        if then == "cancel":
            req.cancel_requested = True
            req.cancel_scope.cancel()
            await trio.lowlevel.checkpoint()

    def _active(self, nth: int) -> Req | None:
        """The ``nth`` newest request that has not ended (counting round), if any."""
        active = [r for r in self.reqs if not r.over]
        return active[-1 - nth % len(active)] if active else None

    @precondition(lambda self: not self.stopped)
    @rule(nth=st.integers(0, 3))
    def cancel(self, nth: int) -> None:
        """Cancel the ``nth`` newest running request's consumer."""
        self.call(self._cancel, nth)

    async def _cancel(self, nth: int) -> None:
        req = self._active(nth)
        if req is None:
            return
        req.cancel_requested = True
        req.cancel_scope.cancel()
        with trio.move_on_after(DEATH_BOUND_S):
            while not req.task_done:
                await trio.sleep(0.001)
        assert req.task_done, f"{req!r}: its consumer did not end within {DEATH_BOUND_S}s of being cancelled"

    @precondition(lambda self: not self.stopped)
    @rule(nth=st.integers(0, 3), duration=st.sampled_from([0.05, 0.3]), then=st.sampled_from(["resume", "cancel"]))
    def stall(self, nth: int, duration: float, then: str) -> None:
        """The ``nth`` newest running request's consumer stops reading for
        ``duration``, then reads again or cancels the request."""
        self.call(self._stall, nth, duration, then)

    async def _stall(self, nth: int, duration: float, then: str) -> None:
        req = self._active(nth)
        if req is None or req.stalled or req.stall_request is not None:
            return
        req.stall_request = (duration, then)
        if req.read_scope is not None:
            req.read_scope.cancel()  # stop reading now: the read loses nothing

    @precondition(lambda self: not self.stopped and len(self.reqs) > self.requests_at_last_fault)
    @rule(
        fault=st.sampled_from(["kill -9 worker", "kill -9 engine core", "SIGUSR1 worker"]),
        engine=st.integers(0, 1),
        rank=st.integers(0, 1),
    )
    def inject(self, fault: str, engine: int, rank: int) -> None:
        """A fault of one engine (``engine``, modulo their number): kill -9
        one of its workers or its engine core, or make one of its workers'
        next step raise (SIGUSR1). ``rank`` picks the worker. (At most one
        fault per submission, so that most requests still run to the end.)"""
        self.requests_at_last_fault = len(self.reqs)
        index = engine % self.data_parallel_size
        if fault == "SIGUSR1 worker":
            self.call(self._raise_in_next_step, index, rank)
        else:
            self.call(self._kill, fault.removeprefix("kill -9 "), index, rank)

    async def _kill(self, what: str, index: int, rank: int) -> None:
        gen = await self._wait_ready(index)
        pid = gen.engine_pid if what == "engine core" else gen.worker_pids[rank % len(gen.worker_pids)]
        try:
            gen.procs[pid].kill()  # psutil: never a reused pid
        except psutil.NoSuchProcess:
            return  # it died of something else meanwhile: noticed by the invariants
        self.num_faults[index] += 1
        killed_at = now()
        for req in self.reqs:
            req.death(killed_at, gen.engine_pid)
        with trio.move_on_after(DEATH_BOUND_S):
            while self.gens[index] is gen:
                await trio.sleep(0.005)
                self._observe()
        assert self.gens[index] is not gen, (
            f"the front-end did not notice within {DEATH_BOUND_S}s that engine {index}'s {what} (pid {pid}) was killed"
        )
        # The requests in flight must end by their deadline: wait for them (a bounded wait).
        while any(not r.over and not r.stalled and r.death_deadline < math.inf for r in self.reqs):
            if now() > max(r.death_deadline for r in self.reqs if not r.over and r.death_deadline < math.inf) + 0.1:
                break
            await trio.sleep(0.005)

    async def _raise_in_next_step(self, index: int, rank: int) -> None:
        gen = await self._wait_ready(index)
        pid = gen.worker_pids[rank % len(gen.worker_pids)]
        try:
            gen.procs[pid].send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            return
        self.num_faults[index] += 1
        # Its next step fails: any request on this engine core, or sent to it from now on, may end dead.
        self.fault_pending[index] = True
        for req in self.reqs:
            if not req.over and req.entered_pid in (None, gen.engine_pid):
                req.risky_pids.add(gen.engine_pid)

    @precondition(lambda self: not self.stopped)
    @rule(seconds=st.sampled_from([0.02, 0.2]))
    def pause(self, seconds: float) -> None:
        self.call(self._pause, seconds)

    async def _pause(self, seconds: float) -> None:
        end = now() + seconds
        while now() < end:
            self._observe()
            await trio.sleep(0.005)

    @precondition(lambda self: not self.stopped)
    @rule()
    def settle(self) -> None:
        """Wait for every request whose consumer reads to end."""
        self.call(self._settle, False)

    async def _settle(self, resume_stalled: bool) -> None:
        while True:
            self._observe()
            waiting = [r for r in self.reqs if not r.over and (resume_stalled or not r.stalled)]
            if not waiting:
                return
            late = [r for r in waiting if r.active_time(now()) > HANG_BOUND_S]
            assert not late, f"requests hang: {late} have had no terminal event for {HANG_BOUND_S}s"
            await trio.sleep(0.005)

    @precondition(lambda self: not self.stopped and len(self.reqs) >= MIN_REQUESTS_BEFORE_SHUTDOWN)
    @rule(drain=st.booleans())
    def shutdown(self, drain: bool) -> None:
        """Exit open_engine: after the requests end (drain), or cancelling them."""
        if drain:
            self.call(self._settle, True)
        self._shutdown_and_check()

    @precondition(lambda self: self.stopped)
    @rule()
    def reopen(self) -> None:
        self.stopped = False
        self._open()

    # --- invariants -----------------------------------------------------------

    @invariant()
    def each_request_ends_once_and_as_the_model_says(self) -> None:
        if self.harness is None or self.stopped:
            return
        problems = self.call(self._request_problems)
        assert not problems, "requests: " + "; ".join(problems)

    async def _request_problems(self) -> list[str]:
        self._observe()
        at = now()
        problems = [p for r in self.reqs for p in r.violations()]
        late = [r for r in self.reqs if not r.over and r.active_time(at) > HANG_BOUND_S]
        if late:
            problems.append(f"requests hang: {late} have had no terminal event for {HANG_BOUND_S}s")
        return problems

    @invariant()
    def processes_are_exactly_the_engines(self) -> None:
        if self.harness is None or self.stopped:
            return
        problems = self.call(self._wait_for_processes)
        assert not problems, "processes: " + "; ".join(problems)

    async def _wait_for_processes(self) -> list[str]:
        """Poll up to ``ORPHAN_BOUND_S`` for the processes to match the engine's."""
        deadline = now() + ORPHAN_BOUND_S
        while True:
            self._observe()
            problems = self._process_problems()
            if not problems or now() > deadline:
                return problems
            await trio.sleep(0.02)

    def _process_problems(self) -> list[str]:
        problems = []
        live = trioserve_processes()
        zombies = [p.pid for p in live if is_zombie(p)]
        if zombies:
            problems.append(f"unreaped zombies {zombies}")
        for pid, proc in list(self.retired.items()):
            if still_there(proc):
                problems.append(f"pid {pid} of a dead engine core is still there")
            else:
                del self.retired[pid]
        known = [gen for gen in self.gens if gen is not None]
        expected = {pid for gen in known for pid in (gen.engine_pid, *gen.worker_pids)}
        running = {p.pid for p in live if not is_zombie(p)}
        if len(known) == len(self.gens):  # every engine ready: exactly their processes
            if running != expected:
                problems.append(f"trioserve processes {sorted(running)} are not the engines' {sorted(expected)}")
        else:  # one restarting: its new processes are not known yet, but no more than one engine's each
            if not expected <= running:
                problems.append(f"processes {sorted(expected - running)} of ready engines are gone")
            room = (len(self.gens) - len(known)) * (1 + self.tensor_parallel_size)
            if len(running - expected) > room:
                problems.append(
                    f"trioserve processes {sorted(running - expected)} beyond the ready engines' are more than "
                    f"the {room} of the engines restarting"
                )
        return problems

    @invariant()
    def restarts_match_deaths(self) -> None:
        if self.harness is None or self.stopped:
            return
        self.call(self._check_restarts)

    async def _check_restarts(self) -> None:
        """Each engine restarted once per death of its engine core, and its
        engine core died only of a fault injected into it."""
        self._observe()
        assert not self.unexplained_deaths, (
            f"engine cores died with no fault injected into their engine: {self.unexplained_deaths}"
        )
        engine = self.engine
        assert engine.health in ("ready", "restarting"), f"engine health is {engine.health!r} with restarts left"
        for index, (health, gen) in enumerate(zip(engine.engine_healths, self.gens, strict=True)):
            assert health in ("ready", "restarting"), f"engine {index}'s health is {health!r} with restarts left"
            restarts = supervisors(engine)[index].num_restarts
            if gen is not None:
                assert restarts == self.num_deaths[index], (
                    f"engine {index}: {restarts} restarts after {self.num_deaths[index]} deaths of its engine core"
                )
        if all(gen is not None for gen in self.gens):
            assert engine.num_restarts == sum(self.num_deaths), (
                f"{engine.num_restarts} restarts in all after {sum(self.num_deaths)} deaths of engine cores"
            )

    @invariant()
    def no_request_state_outlives_its_request(self) -> None:
        """The front-end holds, and the engine core runs or queues, no more
        requests than have not ended; with none running, every KV block is
        free. (So, once idle: nothing held, nothing running, all blocks free.)"""
        if self.harness is None or self.stopped:
            return
        self.call(self._check_request_state)

    async def _check_request_state(self) -> None:
        self._observe()
        if all(gen is None for gen in self.gens):
            return  # all restarting: their next engine cores start empty
        engine = self.engine
        live = [r for r in self.reqs if not r.over]  # counted before stats: an abort sent later is not seen by it
        held_in_all = engine.num_requests_in_flight()
        held = [0 if s.client is None else len(s.client.requests) for s in supervisors(engine)]
        on_before = {r.n: r.now_on for r in live}  # (a request resumed meanwhile is counted where it was and is)
        try:
            stats = await engine.stats()
        except EngineDeadError:
            # A pending SIGUSR1 fails the next step (of any request, one cancelled meanwhile too).
            assert any(self.fault_pending), "an engine core died with no fault pending"
            return
        assert held_in_all <= len(live), (
            f"{len(live)} request(s) not ended {live}, yet the front-end holds {held_in_all}"
        )
        for index, (gen, counts) in enumerate(zip(self.gens, stats.engines or [stats], strict=True)):
            if gen is None:
                continue  # restarting: its next engine core starts empty
            here = [r for r in live if index in (r.now_on, on_before[r.n]) or None in (r.now_on, on_before[r.n])]
            # (None: on its way to an engine)
            in_use = counts.num_total_blocks - counts.num_free_blocks
            assert held[index] <= len(here) and counts.num_running + counts.num_waiting <= len(here), (
                f"{len(here)} request(s) not ended at engine {index} {here}, yet the front-end holds {held[index]} "
                f"there and its engine core has {counts.num_running} running and {counts.num_waiting} waiting "
                f"({in_use} KV blocks in use)"
            )
            assert counts.num_running > 0 or in_use == 0, (
                f"engine {index}: no request running, yet {in_use} KV blocks in use"
            )

    # --- shutdown and teardown ------------------------------------------------

    def _shutdown_and_check(self) -> None:
        """Exit open_engine; then every request has ended exactly once, no
        process remains, and no file descriptor leaked."""
        assert self.harness is not None
        self.stopped = True
        harness, self.harness = self.harness, None
        harness.stop()
        problems = [p for r in self.reqs for p in r.violations()]
        problems += [f"{r!r}: no terminal event after shutdown" for r in self.reqs if not r.over]
        assert not problems, "requests at shutdown: " + "; ".join(problems)
        self._check_nothing_left()
        self._check_fds()

    def _check_nothing_left(self) -> None:
        for gen in self.gens:
            if gen is not None:
                self.retired.update(gen.procs)
        self.gens = [None] * self.data_parallel_size
        deadline = now() + ORPHAN_BOUND_S
        while True:
            left = [p for p in trioserve_processes() if still_there(p)]
            left += [p for p in self.retired.values() if still_there(p) and p not in left]
            if not left or now() > deadline:
                break
            time.sleep(0.02)
        assert not left, f"processes left {ORPHAN_BOUND_S}s after shutdown: {left}"
        self.retired.clear()

    def _check_fds(self) -> None:
        deadline = now() + 1.0  # zmq closes a socket's fds in its own thread
        while True:
            added = {fd: target for fd, target in fd_table().items() if self.fds_before.get(fd) != target}
            if not added or now() > deadline:
                break
            time.sleep(0.02)
        assert not added, f"file descriptors leaked: {added}"

    def teardown(self) -> None:
        if self.harness is None:
            return
        try:
            self.call(self._settle, True)
        finally:
            try:
                self._shutdown_and_check()
            finally:
                for proc in trioserve_processes():  # whatever failed, leave nothing behind
                    with contextlib.suppress(psutil.Error):
                        proc.kill()


@pytest.fixture(scope="module")
def lifecycle_model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def warm_up_process_wide_state() -> None:
    """Create what a process creates once and keeps for its whole life, so
    that the per-example descriptor count compares like with like: the one
    zmq context (``zmq_trio.zmq_context``) and its I/O thread's descriptors,
    which appear with its first socket."""
    zmq_context().socket(zmq.PULL).close()


# Starting an engine costs seconds (up to six processes on a loaded machine): ten examples keep
# the test near a minute.
LIFECYCLE_SETTINGS = settings(
    max_examples=10,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,  # the same examples on every run: no database, nothing written
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_engine_lifecycle_under_random_faults(lifecycle_model_dir: str) -> None:
    warm_up_process_wide_state()
    LifecycleMachine.model_dir = lifecycle_model_dir
    run_state_machine_as_test(LifecycleMachine, settings=LIFECYCLE_SETTINGS)
    assert [p for p in trioserve_processes() if still_there(p)] == []
