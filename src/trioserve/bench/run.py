"""One benchmark run, end to end: the workload through an in-process engine
or a running server (inside ``trio.run``), then the baselines, each in its
own process, one after the other (never two measurements at once)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import msgspec
import trio

from trioserve.api import Engine, open_engine
from trioserve.bench.drivers import Progress, WebSocketPool, connections_for, drive, engine_sender
from trioserve.bench.memory import PeakMemory, cpu_seconds, server_processes
from trioserve.bench.openai_driver import OpenAIServer, served_model
from trioserve.bench.stats import RequestRecord
from trioserve.bench.steps import step_log_env
from trioserve.bench.workload import BenchRequest, WorkloadSpec, build_requests, warmup_spec
from trioserve.config import EngineConfig
from trioserve.errors import RequestError
from trioserve.messages import EngineStats
from trioserve.nurseries.supervision.oneshot import run_oneshot
from trioserve.runners.steplog import StepRecord, read_step_log, step_log_path

BASELINE_KINDS = ("model-only", "generate-batch", "generate")  # run by default
# Run only when asked: our engine again with prefix caching off, and vLLM (bench/vllm_baseline.py).
OPTIONAL_BASELINE_KINDS = ("no-prefix-caching", "vllm")


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    peak_rss_bytes: dict[str, int]
    steps: list[StepRecord] = field(default_factory=list)  # the output worker's own step log, if any
    requests_per_engine: list[int] = field(default_factory=list)  # with several engines: how many each served
    engine_stats: EngineStats | None = None  # in-process: the engine's counters after the run
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # each process's CPU time during the run


async def run_in_process(config: EngineConfig, spec: WorkloadSpec, progress: Progress) -> RunOutcome:
    """Start an engine, warm it up (two short requests, not counted), run the
    workload, read the processes' peak memory, stop the engine. The worker
    logs each step's timing (``trioserve.runners.steplog``) for the figures
    of the same run."""
    requests = build_requests(spec)
    with tempfile.TemporaryDirectory(prefix="trioserve-bench-") as tmp, step_log_env(os.path.join(tmp, "steps")):
        async with open_engine(config=config) as engine:  # its processes inherit the step log's path
            pids = {"front-end + bench": os.getpid(), **_engine_pids(engine)}
            before = await engine.stats()
            outcome = await _measure(requests, spec, engine_sender(engine), PeakMemory(pids), progress)
            after = await engine.stats()
            outcome.requests_per_engine = [
                b.num_requests - a.num_requests for a, b in zip(before.engines, after.engines, strict=True)
            ]
            outcome.engine_stats = after
        outcome.steps = read_step_log(step_log_path(os.path.join(tmp, "steps"), 0))
    return outcome


def _engine_pids(engine: Engine) -> dict[str, int]:
    """Each engine core's and worker's pid, by name (``engine-core``, ``worker-0``
    with one engine; ``engine-core-1``, ``worker-1.0`` with several)."""
    infos = engine.engine_infos
    if len(infos) == 1:
        info = infos[0]
        return {"engine-core": info.engine_pid, **{f"worker-{r}": pid for r, pid in enumerate(info.worker_pids)}}
    pids = {}
    for i, info in enumerate(infos):
        pids[f"engine-core-{i}"] = info.engine_pid
        pids.update({f"worker-{i}.{r}": pid for r, pid in enumerate(info.worker_pids)})
    return pids


async def run_against_server(url: str, api_key: str | None, spec: WorkloadSpec, progress: Progress) -> RunOutcome:
    """Run the workload against a running server over WebSocket. Peak memory
    covers the server's processes when they run on this machine."""
    requests = build_requests(spec)
    port = urlparse(url).port or (443 if url.startswith("wss") else 80)
    pids = {"bench client": os.getpid(), **server_processes(port)}
    pool = WebSocketPool(url, connections_for(spec), api_key)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        outcome = await _measure(requests, spec, pool.send, PeakMemory(pids), progress)
        nursery.cancel_scope.cancel()
    return outcome


async def run_against_openai(url: str, api_key: str | None, spec: WorkloadSpec, progress: Progress) -> RunOutcome:
    """Run the workload against a running OpenAI-compatible server (trioserve's or vLLM's) over HTTP
    (``openai_driver.py``). Peak memory covers the server's processes when they run on this machine."""
    requests = build_requests(spec)
    model = await trio.to_thread.run_sync(served_model, url, api_key)
    server = OpenAIServer(url, model, api_key)
    pids = {"bench client": os.getpid(), **server_processes(server.port)}
    return await _measure(requests, spec, server.sender(), PeakMemory(pids), progress)


async def _measure(
    requests: list[BenchRequest], spec: WorkloadSpec, send: Any, memory: PeakMemory, progress: Progress
) -> RunOutcome:
    warm_spec = warmup_spec(spec.vocab_size)
    warm = await drive(build_requests(warm_spec), warm_spec, send)
    if not all(r.ok for r in warm):
        # One line from the command (a RequestError), not a traceback.
        raise RequestError(f"the benchmark's warm-up request failed: {next(r.error for r in warm if not r.ok)}")
    async with trio.open_nursery() as nursery:
        await nursery.start(memory.run)
        cpu_before = cpu_seconds(memory.pids)
        progress.started = time.perf_counter()
        records = await drive(requests, spec, send, progress)
        cpu_after = cpu_seconds(memory.pids)
        peaks = memory.peaks()
        nursery.cancel_scope.cancel()
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after if name in cpu_before}
    return RunOutcome(records, peaks, cpu_seconds=cpu)


def run_baseline(kind: str, config: EngineConfig, spec: WorkloadSpec, timeout_s: float | None = None) -> dict[str, Any]:
    """One baseline in a supervised child process (``nurseries/supervision/oneshot.py``:
    it ends with this process, however this one ends); its JSON, or
    ``{"error": ...}``. Raises ``StoppedBySignal`` after a SIGTERM or SIGHUP
    (and ``KeyboardInterrupt`` after a SIGINT), once the child is gone."""
    args = [kind, "--config", msgspec.json.encode(config).decode(), "--spec", json.dumps(spec.to_dict())]
    done = run_oneshot("trioserve.bench.baselines", args, name=f"{kind} baseline", capture=True, timeout_s=timeout_s)
    if done.timed_out:
        return {"kind": kind, "error": f"timed out after {timeout_s:.0f} s"}
    if done.exit_code != 0:
        return {"kind": kind, "error": f"exit {done.exit_code}: {_last_words(done.stderr)}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _last_words(stderr: str) -> str:
    """Why a one-shot process failed, from its stderr: its one "failed:" line
    without the process's name, or, when that only gives an exit code, the
    line above it (an argument parser's message, say)."""
    lines = stderr.strip().splitlines() or ["(no output)"]
    failed = re.fullmatch(r"trioserve-oneshot \(pid \d+\) failed: (.*)", lines[-1])
    if failed is None:
        return lines[-1]
    if re.search(r"exited with code -?\d+$", failed.group(1)) and len(lines) > 1:
        return lines[-2]
    return failed.group(1)
