"""Profile the model runner on the bench workload (the model-only loop)::

    PYTHONPATH=src python scripts/profile_runner.py --model smollm2-135m \
        --num-requests 32 --torch-threads 1 [--dtype bfloat16 | --quantization int8] [--compile]

Runs the ``model-only`` baseline's closed loop (our scheduler and
``ModelRunner``, no IPC) under ``torch.profiler`` and prints the operators
by self CPU time, then the step times split into decode-only steps and
steps with prefill tokens.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from trioserve.bench.baselines import _ModelOnly, _warmup_requests
from trioserve.bench.models import resolve_model
from trioserve.bench.workload import WorkloadSpec, build_requests, parse_range
from trioserve.config import EngineConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", default="32-256")
    p.add_argument("--output-len", default="64")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with (prefix caching)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=["int8"], default=None)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-profiler", action="store_true")
    p.add_argument("--compile", action="store_true", help="the compiled model (gpu/compiled.py)")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, max_num_seqs=args.concurrency, torch_threads=args.torch_threads,
        kv_cache_memory_bytes=512 * 2**20, compile=args.compile, quantization=args.quantization,
    )  # fmt: skip
    vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
    spec = WorkloadSpec(
        num_requests=args.num_requests, prompt_len=parse_range(args.prompt_len),
        output_len=parse_range(args.output_len), vocab_size=vocab, seed=0, concurrency=args.concurrency,
        shared_prefix_len=args.shared_prefix_len,
    )  # fmt: skip
    started = time.perf_counter()
    bench = _ModelOnly(config)
    print(f"load: {time.perf_counter() - started:.1f} s (compiling: {bench.runner.compile_seconds:.1f} s)")
    started = time.perf_counter()
    bench.run(_warmup_requests(spec), None)
    print(f"warm-up: {time.perf_counter() - started:.1f} s")
    requests = build_requests(spec)
    if args.no_profiler:
        steps, _ = bench.run(requests, spec.concurrency)
    else:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps, _ = bench.run(requests, spec.concurrency)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(s for _, _, s in steps)
    tokens = sum(r.max_tokens for r in requests)
    decode = [s for t, n, s in steps if t == n]
    mixed = [s for t, n, s in steps if t != n]
    print(f"{len(steps)} steps, {total:.2f} s in execute(), {tokens / total:.1f} output tokens/s")
    print(f"decode-only steps: {len(decode)}, {sum(decode):.2f} s; with prefill: {len(mixed)}, {sum(mixed):.2f} s")


if __name__ == "__main__":
    main()
