"""The benchmark's shared-prefix workload, its prefix-caching figures, and the
vLLM baseline's plumbing (job, command, environment, result), driven by a
fake interpreter: vLLM itself is never needed by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import trio
from helpers.fakes import VOCAB

from trioserve.bench import vllm_driver
from trioserve.bench.cli import cmd_bench
from trioserve.bench.drivers import Progress
from trioserve.bench.report import build_result, engine_baseline, engine_figures, format_table
from trioserve.bench.run import run_in_process
from trioserve.bench.stats import summarize
from trioserve.bench.vllm_baseline import VLLM_DRIVER, parse_vllm_result, run_vllm, vllm_env, vllm_job
from trioserve.bench.workload import WorkloadSpec, build_requests
from trioserve.config import EngineConfig


def spec(**changes) -> WorkloadSpec:
    options = dict(num_requests=6, prompt_len=(4, 9), output_len=(3, 5), vocab_size=VOCAB, seed=3, concurrency=2)
    return WorkloadSpec(**{**options, **changes})


def test_every_prompt_starts_with_the_same_prefix_and_the_rest_does_not_change():
    shared = build_requests(spec(shared_prefix_len=40))
    plain = build_requests(spec())
    prefix = shared[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix for r in shared)
    assert [r.prompt_token_ids[40:] for r in shared] == [r.prompt_token_ids for r in plain]
    assert [r.max_tokens for r in shared] == [r.max_tokens for r in plain]
    assert spec(shared_prefix_len=40).max_prompt_len == 49
    with pytest.raises(ValueError, match="shared_prefix_len"):
        spec(shared_prefix_len=-1)


async def test_shared_prefix_run_reports_the_hit_rate(fake_config):
    workload = spec(shared_prefix_len=40, num_requests=8)
    with trio.fail_after(60):
        outcome = await run_in_process(fake_config(step_delay_s=0.002), workload, Progress(8, enabled=False))
        without = await run_in_process(
            fake_config(step_delay_s=0.002, enable_prefix_caching=False), workload, Progress(8, enabled=False)
        )
    stats = outcome.engine_stats
    assert stats is not None and stats.prefix_caching
    # The 40-token prefix is 10 blocks of 4; each request after the first (or
    # its concurrent twin) finds them.
    assert stats.prefix_cache_hits >= 6 * 40
    run = summarize(outcome.records) | {"engine": engine_figures(stats)}
    baselines = {"no-prefix-caching": engine_baseline("no-prefix-caching", summarize(without.records))}
    result = build_result(run, outcome.peak_rss_bytes, baselines, {"driver": "x", "workload_text": "y", "model": "z"})
    table = format_table(result)
    assert "prefix cache hit rate" in table and "our engine, prefix caching off" in table
    assert "TTFT p50 >= 3x lower than without caching" in result["targets"]
    assert without.engine_stats is not None and without.engine_stats.prefix_cache_hits == 0


def test_the_vllm_job_holds_the_same_requests_and_limits(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=7, max_num_batched_tokens=99)
    workload = spec(shared_prefix_len=40)
    job = vllm_job(config, workload)
    assert job["requests"] == [[r.prompt_token_ids, r.max_tokens] for r in build_requests(workload)]
    assert (job["max_num_seqs"], job["max_num_batched_tokens"], job["concurrency"]) == (7, 99, 2)
    assert job["enable_prefix_caching"] is True and job["dtype"] == "float32"
    assert job["max_model_len"] == 49 + 5
    assert len(job["warmup"]) == 2
    env = vllm_env(config.replace(torch_threads=3, kv_cache_memory_bytes=1536 * 2**20), {"PYTHONPATH": "x", "A": "b"})
    assert env == {"A": "b", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-2"}
    assert vllm_env(config.replace(torch_threads=1), {})["VLLM_CPU_OMP_THREADS_BIND"] == "0"


FAKE_INTERPRETER = """\
#!{python}
# Plays vLLM's interpreter: records how it was called, answers from the job.
import json, os, sys
driver, job_path, result_path = sys.argv[1:]
job = json.load(open(job_path))
with open({record!r}, "w") as f:
    json.dump({{"driver": driver, "env": dict(os.environ), "num_requests": len(job["requests"])}}, f)
if job["max_num_seqs"] == 13:
    print("RuntimeError: no such model", file=sys.stderr)
    sys.exit(1)
tokens = sum(max_tokens for _, max_tokens in job["requests"])
result = {{"seconds": 2.0, "output_tokens": tokens, "num_requests": len(job["requests"]),
          "ttfts_s": [0.1, 0.2, 0.3], "itls_s": [0.05, 0.07], "vllm_version": "fake"}}
print("vLLM logs on stdout, even as it exits")
json.dump(result, open(result_path, "w"))
"""


def fake_interpreter(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "record.json"
    path = tmp_path / "python"
    path.write_text(FAKE_INTERPRETER.format(python=sys.executable, record=str(record)))
    path.chmod(0o755)
    return path, record


def test_vllm_baseline_runs_the_driver_with_the_interpreter_and_reads_its_result(tiny_model_dir, tmp_path):
    python, record = fake_interpreter(tmp_path)
    config = EngineConfig(model=str(tiny_model_dir("llama")))
    workload = spec()
    result = run_vllm(str(python), config, workload, timeout_s=60)
    called = json.loads(record.read_text())
    assert called["driver"] == str(VLLM_DRIVER) and called["num_requests"] == 6
    assert "PYTHONPATH" not in called["env"] and called["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    tokens = sum(r.max_tokens for r in build_requests(workload))
    assert result["kind"] == "vllm" and result["output_tokens"] == tokens
    assert result["output_tokens_per_s"] == tokens / 2.0 and result["requests_per_s"] == 3.0
    assert result["ttft_p50_s"] == pytest.approx(0.2) and result["itl_p50_s"] == pytest.approx(0.06)
    assert result["vllm_version"] == "fake"


def test_vllm_baseline_reports_a_failure_with_the_drivers_error(tiny_model_dir, tmp_path):
    python, _ = fake_interpreter(tmp_path)
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=13)
    assert run_vllm(str(python), config, spec()) == {"kind": "vllm", "error": "exit 1: RuntimeError: no such model"}
    missing = run_vllm(str(tmp_path / "nowhere"), config, spec())
    assert "no interpreter" in missing["error"]


def test_vllm_result_ratios_and_target():
    vllm = parse_vllm_result(
        json.dumps({"seconds": 4.0, "output_tokens": 400, "num_requests": 8, "ttfts_s": [1.0], "itls_s": [0.1]})
    )
    run = {
        "output_tokens_per_s": 150.0,
        "ttft_s": {"p50": 0.5, "p99": 0.9},
        "itl_s": {"p50": 0.1, "p99": 0.2},
        "duration_s": 1.0,
        "num_completed": 8,
        "num_requests": 8,
        "num_errors": 0,
        "requests_per_s": 8.0,
        "e2e_s": {"p50": 1.0, "p99": 1.0},
    }
    result = build_result(run, {}, {"vllm": vllm}, {"driver": "x", "workload_text": "y", "model": "z"})
    assert result["throughput_ratio"]["vllm"] == 1.5 and result["ttft_p50_ratio"]["vllm"] == 0.5
    assert result["targets"]["tokens/s >= 1.0x vLLM"]["met"]
    assert result["targets"]["tokens/s >= 1.2x vLLM (issue 13)"]["met"]  # 1.5x
    table = format_table(result)
    assert "vLLM offline engine" in table
    assert [line.split()[-1] for line in table.splitlines() if "vLLM offline engine" in line] == ["-"]  # not measured


def test_vllm_peak_memory_is_its_processes_together():
    raw = {"seconds": 1.0, "output_tokens": 1, "num_requests": 1, "ttfts_s": [1.0], "itls_s": []}
    measured = parse_vllm_result(json.dumps({**raw, "peak_rss_bytes_by_pid": {"10": 3 * 2**20, "11": 2**30}}))
    assert measured["peak_rss_bytes"] == 3 * 2**20 + 2**30
    assert "peak_rss_bytes" not in parse_vllm_result(json.dumps(raw))


def test_vllm_driver_reads_peaks_of_itself_and_its_children():
    """The driver's own reading of /proc (it runs standalone, in vLLM's interpreter)."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as child:
        try:
            peaks = vllm_driver.peak_rss_bytes()
        finally:
            child.kill()
    assert set(peaks) >= {str(os.getpid()), str(child.pid)}
    assert peaks[str(os.getpid())] > 10 * 2**20 and peaks[str(child.pid)] > 0


def test_baselines_vllm_needs_an_interpreter():
    args = types.SimpleNamespace(baselines="vllm", vllm_python=None)
    with pytest.raises(ValueError, match="--vllm-python"):
        cmd_bench(args)  # type: ignore[arg-type]


class FakeOutput:
    def __init__(self, request_id: str, num_tokens: int, finished: bool, num_cached_tokens: int | None) -> None:
        self.request_id, self.finished = request_id, finished
        self.outputs = [types.SimpleNamespace(token_ids=list(range(num_tokens)))]
        self.num_cached_tokens = num_cached_tokens  # vLLM's: None until it knows


class FakeEngine:
    """vLLM's LLMEngine as the driver uses it: each step gives every request
    one more token (cumulative, as vLLM does), and keeps an internal id."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}  # id -> [tokens so far, max_tokens]
        self.most_in_flight = 0

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [0, params.max_tokens]
        self.most_in_flight = max(self.most_in_flight, len(self.requests))
        return request_id + "-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] == state[1]
            outputs.append(FakeOutput(request_id, state[0], done, len(request_id) if done else None))
            if state[0] == state[1]:
                del self.requests[request_id]
        return outputs


def test_the_vllm_driver_keeps_concurrency_requests_in_flight_and_times_them(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = types.SimpleNamespace  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = FakeEngine()
    result = vllm_driver.run(engine, [[[5, 6], 3], [[7], 2], [[8, 9], 4], [[1], 1]], concurrency=2)
    assert engine.most_in_flight == 2
    assert result["output_tokens"] == 10 and result["num_requests"] == 4
    assert len(result["ttfts_s"]) == 4 and len(result["itls_s"]) == 10 - 4
    assert result["cached_prompt_tokens"] == 4 * 2  # each request's, from its final output ("r0" .. "r3": 2 each)


def test_the_vllm_driver_is_a_script_for_another_interpreter():
    source = Path(vllm_driver.__file__).read_text()
    assert 'if __name__ == "__main__":' in source  # vLLM's engine core is started with spawn
    assert "trioserve" not in textwrap.dedent(source).split('"""', 2)[2]  # no import of ours after the docstring
