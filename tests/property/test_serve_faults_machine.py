"""``serve --api-server-count 2`` under random faults: a hypothesis state
machine over the whole process tree (the supervising process, two API
servers, the engine core and its worker; the fake runner), under a light load
of WebSocket streams.

Faults: ``kill -9`` or ``SIGSTOP`` of any process kind (an API server, the
engine core, its worker), at the first start (the API servers, at every point
of their start-up) or while serving, and of an API server's replacement at
every point of its start-up (as soon as it exists, a moment later, once it
runs its event loop). A stopped process is never continued: it must be found
hung (by its heartbeats, or the start-up deadline) and killed.

Checked: ``serve`` says it is serving once it can (whatever happened to the
first API servers; a fault in the engine core or its worker before the
engine first starts may instead end ``serve`` with exit 3 naming the engine
core, as every failure of the first start does); every stream ends (its tokens, an error, or its
connection closed when its API server died) within a bound; after each fault
service returns (two API servers, a fresh stream finishes); after SIGTERM,
``serve`` exits 0 and no process of its tree is left. Derandomized; no
database.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio
from helpers.serving import serve_argv, spawned, tree_of, wait_for_url
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

KINDS = ["api-server", "engine-core", "worker"]
FAULTS = ["kill -9", "SIGSTOP"]
HEARTBEAT = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", "--startup-timeout", "4")
OPTIONS = ("--fake-options", '{"step_delay_s": 0.004}', "--max-restarts", "1000", *HEARTBEAT)
STREAM_BOUND_S = 20.0  # a stream ends within this of its start (its process found hung: about 1 s)
SERVICE_BOUND_S = 45.0  # service is back within this of a fault (restarts back off: 0.5 s, doubling)
START_BOUND_S = 60.0
STOP_BOUND_S = 30.0


def processes(top: int, kind: str) -> list[psutil.Process]:
    """The live (not stopped, not zombie) processes of ``kind`` under ``top``."""
    found = []
    for p in psutil.Process(top).children(recursive=True):
        try:
            argv = p.cmdline()
            if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                continue
        except psutil.NoSuchProcess:
            continue
        if (
            (kind == "api-server" and argv[-2:] == ["-m", "trioserve.server.api_servers"])
            or (kind == "engine-core" and argv[-1:] == ["engine-core"])
            or (kind == "worker" and argv[-1:] == ["worker"])
        ):
            found.append(p)
    return found


def inject(process: psutil.Process, fault: str) -> psutil.Process:
    try:
        process.send_signal(signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)
    except psutil.NoSuchProcess:
        pass  # gone meanwhile: the fault came too late
    return process


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclass
class Stream:
    started: float
    ended: float | None = None
    outcome: str = ""  # "done", an error type, or "closed"
    tokens: list[int] = field(default_factory=list)


def run_stream(url: str, stream: Stream, max_tokens: int) -> None:
    """One request on a WebSocket of its own, read to its end."""
    try:
        with connect(url, open_timeout=STREAM_BOUND_S, close_timeout=1) as ws:
            params = {"max_tokens": max_tokens, "ignore_eos": True}
            ws.send(json.dumps({"type": "generate", "id": "s", "prompt_token_ids": [5, 6, 7], "params": params}))
            while True:
                message = json.loads(ws.recv(timeout=STREAM_BOUND_S))
                stream.tokens += message.get("token_ids", [])
                if message["type"] in ("done", "error"):
                    stream.outcome = message["type"] if message["type"] == "done" else message["code"]
                    break
    except (ConnectionClosed, OSError) as exc:
        stream.outcome = f"closed ({type(exc).__name__})"
    except TimeoutError:
        stream.outcome = "timed out"
    finally:
        stream.ended = time.monotonic()


class ServeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[Stream] = []
        self.threads: list[threading.Thread] = []
        self.proc: Any = None
        self.victim: psutil.Process | None = None
        self.url = ""
        self._spawned: Any = None

    @initialize(
        first=st.sampled_from([None, *[(kind, fault) for kind in KINDS for fault in FAULTS]]),
        delay=st.sampled_from([0.0, 0.3, 1.5]),
    )
    def start(self, first: tuple[str, str] | None, delay: float) -> None:
        """Start ``serve``; with ``first``, inject a fault into a process of
        that kind ``delay`` seconds after the first one appears."""
        self._spawned = spawned(
            serve_argv(
                "--model", os.environ["TRIOSERVE_TEST_MODEL"], "--runner", "fake", "--api-server-count", "2", *OPTIONS
            )
        )
        self.proc = self._spawned.__enter__()
        if first is not None:
            kind, fault = first
            deadline = time.monotonic() + START_BOUND_S
            while not (found := processes(self.proc.pid, kind)):
                assert time.monotonic() < deadline, f"no {kind} appeared"
                time.sleep(0.005)
            time.sleep(delay)
            self.victim = inject(found[0], fault)
        try:
            self.url = wait_for_url(self.proc, START_BOUND_S)  # serve says it is serving, whatever happened
        except AssertionError as exc:  # it ended: only a fault in the engine's first start may do that
            assert first is not None and first[0] != "api-server", exc
            assert self.proc.returncode == 3 and "engine-core-0" in str(exc), exc
            self.proc = None  # nothing to stop
            self._spawned.__exit__(None, None, None)
            return
        self.wait_for_service()

    def wait_for_service(self) -> None:
        """The process faulted last is gone (a stopped one found hung and
        killed), two API servers run, and a fresh stream finishes."""
        if self.proc is None:
            return
        deadline = time.monotonic() + SERVICE_BOUND_S
        while self.victim is not None and not gone(self.victim):
            assert time.monotonic() < deadline, f"{self.victim} was never found gone (or hung)"
            time.sleep(0.02)
        while True:
            if len(processes(self.proc.pid, "api-server")) == 2:
                probe = Stream(time.monotonic())
                run_stream(self.url, probe, 3)
                if probe.outcome == "done":
                    return
            assert time.monotonic() < deadline, "service did not return"
            time.sleep(0.1)

    @rule(count=st.integers(1, 3), max_tokens=st.sampled_from([20, 200]))
    def streams_(self, count: int, max_tokens: int) -> None:
        if self.proc is None:
            return
        for _ in range(count):
            stream = Stream(time.monotonic())
            thread = threading.Thread(target=run_stream, args=(self.url, stream, max_tokens), daemon=True)
            thread.start()
            self.streams.append(stream)
            self.threads.append(thread)

    @rule(kind=st.sampled_from(KINDS), fault=st.sampled_from(FAULTS))
    def fault(self, kind: str, fault: str) -> None:
        if self.proc is None:
            return
        if found := processes(self.proc.pid, kind):
            self.victim = inject(found[0], fault)
        self.wait_for_service()

    @rule(fault=st.sampled_from(FAULTS), delay=st.sampled_from([0.0, 0.1, 0.6]))
    def fault_in_a_replacement(self, fault: str, delay: float) -> None:
        """Kill an API server, then inject ``fault`` into its replacement ``delay`` s after it appears."""
        if self.proc is None:
            return
        self.wait_for_service()  # (its last victim gone)
        before = {p.pid for p in processes(self.proc.pid, "api-server")}
        inject(processes(self.proc.pid, "api-server")[0], "kill -9")
        deadline = time.monotonic() + SERVICE_BOUND_S
        while not (new := [p for p in processes(self.proc.pid, "api-server") if p.pid not in before]):
            assert time.monotonic() < deadline, "no replacement API server"
            time.sleep(0.005)
        time.sleep(delay)
        self.victim = inject(new[0], fault)
        self.wait_for_service()

    @invariant()
    def every_stream_ends_within_its_bound(self) -> None:
        now = time.monotonic()
        for stream in self.streams:
            if stream.ended is None:
                assert now - stream.started < STREAM_BOUND_S, "a stream did not end"
            else:
                assert stream.outcome != "timed out"

    def teardown(self) -> None:
        if self.proc is None:
            return
        try:
            for thread in self.threads:
                thread.join(STREAM_BOUND_S)
            assert all(stream.ended is not None for stream in self.streams)
            tree = tree_of(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(STOP_BOUND_S) == 0
            _, alive = psutil.wait_procs([psutil.Process(pid) for pid in tree if psutil.pid_exists(pid)], timeout=5)
            assert not alive, f"left running after SIGTERM: {alive}"
        finally:
            self._spawned.__exit__(None, None, None)


SERVE_FAULTS_SETTINGS = settings(
    max_examples=3,
    stateful_step_count=5,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


async def test_serve_with_two_api_servers_under_random_faults(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TRIOSERVE_TEST_MODEL", str(tiny_model_dir("llama")))
    with trio.fail_after(600):
        await trio.to_thread.run_sync(
            lambda: run_state_machine_as_test(ServeMachine, settings=SERVE_FAULTS_SETTINGS), abandon_on_cancel=True
        )
