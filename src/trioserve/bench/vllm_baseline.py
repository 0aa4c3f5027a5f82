"""vLLM as a baseline: the same requests through vLLM's offline engine, in
vLLM's own interpreter (``--baselines vllm --vllm-python PATH``).

vLLM is not a dependency of trioserve: it lives in a virtual environment of
its own (docs/benchmarks.md says how to make one), and nothing here imports
it. This module writes the job (the workload's requests as token ids, and
our engine's limits), runs ``vllm_driver.py`` with that interpreter, and
turns the JSON it writes into a baseline's figures. vLLM gets what
our worker gets: the same ``max_num_seqs`` and token budget, prefix caching
as ours, float32, as many OpenMP threads as our worker has torch threads
(``VLLM_CPU_OMP_THREADS_BIND``), and at least as much KV-cache memory
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trioserve.bench.stats import percentile
from trioserve.bench.workload import WorkloadSpec, build_requests, warmup_spec
from trioserve.config import EngineConfig, cpu_threads_per_worker

VLLM_DRIVER = Path(__file__).with_name("vllm_driver.py")


def vllm_job(config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    """What the driver runs: the model, the requests, the engine's limits."""
    model_config = json.loads((Path(config.model) / "config.json").read_text())
    context = int(model_config.get("text_config", model_config).get("max_position_embeddings", 2048))
    return {
        "model": config.model,
        "dtype": "float32" if config.dtype == "auto" else config.dtype,
        "seed": config.seed,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": min(context, spec.max_prompt_len + spec.output_len[1]),
        "enable_prefix_caching": config.enable_prefix_caching,
        "concurrency": spec.concurrency,
        "requests": [[r.prompt_token_ids, r.max_tokens] for r in build_requests(spec)],
        "warmup": [[r.prompt_token_ids, r.max_tokens] for r in build_requests(warmup_spec(spec.vocab_size))],
    }


def vllm_command(python: str, job_path: str, result_path: str) -> list[str]:
    return [python, str(VLLM_DRIVER), job_path, result_path]


def vllm_env(config: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment: ours without our Python path, and vLLM's CPU settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(config.kv_cache_memory_bytes / 2**30)))
    threads = cpu_threads_per_worker(config)  # as many as our worker runs with
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    return env


def parse_vllm_result(text: str) -> dict[str, Any]:
    """The driver's result file, as a baseline's figures."""
    raw = json.loads(text)
    seconds, tokens = raw["seconds"], raw["output_tokens"]
    ttfts, itls = raw["ttfts_s"], raw["itls_s"]
    return {
        "kind": "vllm",
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "requests_per_s": raw["num_requests"] / seconds,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "vllm_version": raw.get("vllm_version", "unknown"),
        "cached_prompt_tokens": raw.get("cached_prompt_tokens"),  # None: not reported
        **({"peak_rss_bytes": sum(peaks.values())} if (peaks := raw.get("peak_rss_bytes_by_pid")) else {}),
    }


def run_vllm(python: str, config: EngineConfig, spec: WorkloadSpec, timeout_s: float | None = None) -> dict[str, Any]:
    """Run the workload through vLLM with ``python``; its figures, or ``{"error": ...}``."""
    if not Path(python).exists():
        return {"kind": "vllm", "error": f"no interpreter at {python} (--vllm-python; see docs/benchmarks.md)"}
    with tempfile.TemporaryDirectory(prefix="trioserve-vllm-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), Path(tmp, "result.json")
        Path(job_path).write_text(json.dumps(vllm_job(config, spec)))
        try:
            done = subprocess.run(
                vllm_command(python, job_path, str(result_path)),
                env=vllm_env(config),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"kind": "vllm", "error": f"timed out after {timeout_s:.0f} s"}
        if done.returncode != 0 or not result_path.exists():
            lines = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()
            return {"kind": "vllm", "error": f"exit {done.returncode}: {(lines or ['(no output)'])[-1].strip()}"}
        return parse_vllm_result(result_path.read_text())
