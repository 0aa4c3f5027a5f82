"""The benchmark half of ``scripts/gpu_check.sh`` (issue 35; docs/benchmarks.md, "CUDA (H200)").

Four parts, each its own command so that the shell gives each its own
timeout, and each printing one JSON line per figure (``{"figure": NAME,
"value": ..., ...}``), also appended to ``--summary``:

- ``prepare``: the device's memory bandwidth (``bandwidth_gbps``: a 2 GiB
  device-to-device ``copy_``, bytes read and written over the time, best of
  three rounds of 50 copies), and the model, written once to ``--model-dir``:
  a random Llama-shaped model of 1.04B parameters (hidden 2048, 16 layers, 32
  query and 8 KV heads of 64, MLP 8192, vocabulary 32000, tied embeddings:
  Llama-3.2-1B's shape with a smaller vocabulary) in bfloat16, loadable with
  ``from_pretrained``, with the tiny models' byte-level tokenizer (prompts are
  token ids).
- ``decode-b1``: our model runner's decode step at batch 1 (the median step
  of one request's 256 decodes; ``bench/baselines.py``'s model-only loop)
  against the weights-read roofline, the model's bytes over the measured
  bandwidth (``decode_b1_vs_roofline``, target at most 2).
- ``engine``: ``trioserve bench`` on the model, 256 requests, 64 at once,
  prompts of 32-256 tokens, 64 output tokens, with its model-only baseline
  (``engine_tokens_per_s``; ``engine_vs_model_only``, target at least 0.9).
- ``generate-batch``: transformers' ``generate_batch`` (continuous batching)
  on the same device, dtype and workload, the same step budget and
  concurrency (``engine_vs_generate_batch``, target at least 2). The bench's
  own generate-batch baseline loads the model on the CPU at float32, so this
  one is run here.

``--tiny`` shrinks the model and the workload, so that every part runs on
the CPU in a minute (``--device cpu --dtype float32``): a check of this
script, not a figure::

    python scripts/gpu_bench.py prepare --device cpu --dtype float32 --tiny --work /tmp/gb
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# A random Llama-shaped model of about 1B parameters (Llama-3.2-1B's shape, vocabulary 32000).
LLAMA_1B: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
TINY: dict[str, Any] = {
    **LLAMA_1B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TARGETS = {"engine_vs_model_only": 0.9, "engine_vs_generate_batch": 2.0, "decode_b1_vs_roofline": 2.0}
GIB = 2**30


def emit(summary: Path | None, figure: str, value: float | None, **extra: Any) -> None:
    """Print one figure as a JSON line (NaN as null), and append it to ``summary``."""
    target = TARGETS.get(figure)
    if target is not None:
        lower_is_better = figure == "decode_b1_vs_roofline"
        met = value is not None and (value <= target if lower_is_better else value >= target)
        extra = {"target": target, "better": "lower" if lower_is_better else "higher", "met": met, **extra}
    line = json.dumps({"figure": figure, "value": _finite(value), **{k: _finite(v) for k, v in extra.items()}})
    print(line, flush=True)
    if summary is not None:
        with summary.open("a") as f:
            f.write(line + "\n")


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def figures(summary: Path | None) -> dict[str, dict[str, Any]]:
    """The figures ``summary`` holds so far, by name (the latest of each)."""
    if summary is None or not summary.exists():
        return {}
    lines = [json.loads(line) for line in summary.read_text().splitlines() if line.strip()]
    return {f["figure"]: f for f in lines}


# --- prepare: bandwidth and the model ---------------------------------------------


def measure_bandwidth(device: str, nbytes: int, copies: int = 50, rounds: int = 3) -> float:
    """GB/s of a device-to-device copy of ``nbytes``: read and write both counted."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    sync()
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        sync()
        best = min(best, (time.perf_counter() - started) / copies)
    return 2 * nbytes / best / 1e9


def write_model(out: Path, shape: dict[str, Any], device: str, dtype: str) -> None:
    """A random Llama of ``shape`` in ``dtype``, initialised on ``device``, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
    from transformers.utils import logging

    from trioserve.gpu.tiny_models import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out)
    (out / "complete").touch()


def model_bytes(model_dir: Path) -> int:
    """The bytes of every weight in the model's safetensors files (the files less their headers)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            (header,) = struct.unpack("<Q", f.read(8))
        total += path.stat().st_size - 8 - header
    return total


def cmd_prepare(args: argparse.Namespace) -> None:
    nbytes = 64 * 2**20 if args.tiny else 2 * GIB
    gbps = measure_bandwidth(args.device, nbytes)
    how = f"copy_ of {nbytes / GIB:g} GiB device to device, read + write, best of 3 x 50"
    emit(args.summary, "bandwidth_gbps", gbps, device=args.device, how=how)
    if not (args.model_dir / "complete").exists():
        started = time.perf_counter()
        write_model(args.model_dir, TINY if args.tiny else LLAMA_1B, args.device, args.dtype)
        print(f"gpu_bench: wrote {args.model_dir} in {time.perf_counter() - started:.1f} s", flush=True)
    config = json.loads((args.model_dir / "config.json").read_text())
    params = _parameters(config)
    emit(args.summary, "model_parameters", params, bytes=model_bytes(args.model_dir), dir=str(args.model_dir))


def _parameters(c: dict[str, Any]) -> int:
    """A Llama's parameter count, from its config (tied embeddings counted once)."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    q = c["num_attention_heads"] * c["head_dim"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * c["intermediate_size"] + 2 * h
    head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * h
    return c["num_hidden_layers"] * layer + c["vocab_size"] * h + head + h


# --- decode at batch 1 against the roofline ---------------------------------------


def cmd_decode_b1(args: argparse.Namespace) -> None:
    from trioserve.bench.baselines import run_model_only
    from trioserve.bench.workload import WorkloadSpec
    from trioserve.config import EngineConfig

    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    output = 16 if args.tiny else 256
    spec = WorkloadSpec(
        num_requests=1, prompt_len=(128, 128), output_len=(output, output), vocab_size=vocab, concurrency=1
    )
    config = EngineConfig(
        model=str(args.model_dir), device=args.device, dtype=args.dtype, max_num_seqs=1,
        kv_cache_memory_bytes=256 * 2**20,
    )  # fmt: skip
    step_s = run_model_only(config, spec)["decode_step_p50_s"]
    known = figures(args.summary).get("bandwidth_gbps", {}).get("value")
    gbps = known or measure_bandwidth(args.device, 64 * 2**20 if args.tiny else 2 * GIB)
    weights = model_bytes(args.model_dir)  # read once per decode step (the LM head is the tied embedding)
    roofline_s = weights / (gbps * 1e9)
    emit(
        args.summary, "decode_b1_vs_roofline", step_s / roofline_s if step_s else None,
        decode_step_ms=step_s * 1e3 if step_s else None, roofline_ms=roofline_s * 1e3,
        model_bytes=weights, bandwidth_gbps=gbps, dtype=args.dtype,
    )  # fmt: skip


# --- the engine and its model-only bound ------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    bench_json = args.work / "bench.json"
    bench_json.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "trioserve.cli", "bench", "--model", str(args.model_dir),
        "--device", args.device, "--dtype", args.dtype, "--num-requests", str(args.num_requests),
        "--concurrency", str(args.concurrency), "--max-num-seqs", str(args.concurrency),
        "--prompt-len", args.prompt_len, "--output-len", args.output_len, "--kv-cache-mib", str(args.kv_cache_mib),
        "--baselines", "model-only", "--baseline-timeout", "150", "--json", str(bench_json), "--no-progress",
    ]  # fmt: skip
    print("gpu_bench: " + " ".join(command), flush=True)
    code = subprocess.run(command, check=False).returncode
    if not bench_json.exists():
        emit(args.summary, "engine_tokens_per_s", None, error=f"trioserve bench exited {code} with no result")
        return code or 1
    result = json.loads(bench_json.read_text())
    run = result["results"]
    emit(
        args.summary, "engine_tokens_per_s", run["output_tokens_per_s"], requests=run["num_requests"],
        errors=run["num_errors"], concurrency=args.concurrency, ttft_p50_s=run["ttft_s"]["p50"],
        itl_p50_s=run["itl_s"]["p50"], itl_p99_s=run["itl_s"]["p99"], dtype=args.dtype,
    )  # fmt: skip
    model_only = result["baselines"].get("model-only", {})
    emit(
        args.summary, "engine_vs_model_only", result["throughput_ratio"].get("model-only"),
        model_only_tokens_per_s=model_only.get("output_tokens_per_s"), error=model_only.get("error"),
    )  # fmt: skip
    return code


# --- transformers' generate_batch on the device -----------------------------------


def cb_config(spec: Any, max_batch_tokens: int) -> Any:
    """transformers' continuous batching at our engine's limits: the step's
    token budget, ``concurrency`` requests at once; KV blocks for twice what
    they can hold (never its limit). Its block size is ``page_size`` from
    transformers 5.18 on, ``block_size`` before (the GPU machine has 5.17)."""
    from transformers import ContinuousBatchingConfig

    page = 256
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    size = {"page_size": page} if "page_size" in names else {"block_size": page}
    in_flight = spec.concurrency or spec.num_requests
    return ContinuousBatchingConfig(
        **size,
        num_blocks=2 * in_flight * -(-spec.max_request_len // page),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=in_flight,
    )


def run_generate_batch(model_dir: Path, device: str, dtype: str, spec: Any) -> dict[str, Any]:
    """``generate_batch`` over the workload, timed from the call to its return;
    warmed up first by a call on two of its requests (the longest prompt),
    whose manager (CUDA graphs captured) the timed call reuses."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging

    from trioserve.bench.workload import build_requests

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    requests = build_requests(spec)
    longest = max(r.max_tokens for r in requests)
    greedy = GenerationConfig(
        max_new_tokens=longest, min_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    options = {"continuous_batching_config": cb_config(spec, 2048), "persistent_manager": True}
    warm = sorted(requests, key=lambda r: len(r.prompt_token_ids))[-2:]
    model.generate_batch(inputs=[r.prompt_token_ids for r in warm], generation_config=greedy, **options)
    started = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[r.prompt_token_ids for r in requests], generation_config=greedy, max_new_tokens=longest, **options
    )
    seconds = time.perf_counter() - started
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"seconds": seconds, "generated_tokens": generated, "asked_tokens": sum(r.max_tokens for r in requests)}


def cmd_generate_batch(args: argparse.Namespace) -> None:
    from trioserve.bench.workload import WorkloadSpec

    bench_json = args.work / "bench.json"
    result = json.loads(bench_json.read_text()) if bench_json.exists() else None
    if result is not None:
        spec = WorkloadSpec.from_dict(result["workload"])  # exactly the engine's requests
    else:
        spec = workload(args, json.loads((args.model_dir / "config.json").read_text())["vocab_size"])
    gb = run_generate_batch(args.model_dir, args.device, args.dtype, spec)
    rate = gb["generated_tokens"] / gb["seconds"]
    ours = result["results"]["output_tokens_per_s"] if result is not None else None
    emit(
        args.summary, "engine_vs_generate_batch", ours / rate if ours and rate else None,
        generate_batch_tokens_per_s=rate, engine_tokens_per_s=ours, **gb, dtype=args.dtype,
    )  # fmt: skip


def workload(args: argparse.Namespace, vocab_size: int) -> Any:
    from trioserve.bench.workload import WorkloadSpec, parse_range

    return WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=parse_range(args.prompt_len),
        output_len=parse_range(args.output_len),
        vocab_size=vocab_size,
        concurrency=args.concurrency,
    )


PARTS = {
    "prepare": cmd_prepare,
    "decode-b1": cmd_decode_b1,
    "engine": cmd_engine,
    "generate-batch": cmd_generate_batch,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload: checks this script on a CPU")
    work = Path(os.environ.get("OUT") or "bench-results/gpu-check")
    parser.add_argument("--work", type=Path, default=work, help="where bench.json and the summary go (default: $OUT)")
    parser.add_argument("--summary", type=Path, help="append each figure's line here (default: WORK/summary.jsonl)")
    parser.add_argument("--model-dir", type=Path, help="default: /tmp/trioserve-gpu-bench/llama-1b (or tiny)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", default="32-256")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--kv-cache-mib", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.tiny:
        args.num_requests, args.concurrency, args.prompt_len, args.output_len = 8, 4, "8-32", "8"
        args.kv_cache_mib = min(args.kv_cache_mib, 64)
    args.model_dir = args.model_dir or Path("/tmp/trioserve-gpu-bench") / ("llama-tiny" if args.tiny else "llama-1b")
    args.work.mkdir(parents=True, exist_ok=True)
    args.summary = args.summary or args.work / "summary.jsonl"
    return PARTS[args.part](args) or 0


if __name__ == "__main__":
    sys.exit(main())
