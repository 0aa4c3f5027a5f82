"""Baselines, run in their own process (they import torch)::

    python -m trioserve.bench.baselines KIND --model DIR --spec JSON

prints one JSON object on stdout. ``KIND``:

- ``model-only``: our ``ModelRunner`` stepping the batch shapes our own
  scheduler makes for the same workload (a closed loop holding
  ``concurrency`` requests), in this one process: no IPC, no asyncio/trio,
  no detokenization. Only ``execute()`` is timed: the fastest this model
  goes on this machine through our runner. Its ITL figures are the bench
  client's inter-token latencies on a clock that runs only inside
  ``execute()``: the ITL the workload would have with zero overhead.
- ``generate-batch``: ``transformers``' continuous batching
  (``model.generate_batch``) over all the requests at once.
- ``generate``: ``transformers`` ``model.generate()`` in static batches of
  ``concurrency`` requests, left-padded, each batch generating its longest
  asked output.
- ``peak-gemm``: not a baseline but the yardstick of model FLOP utilisation:
  the best rate of one matrix multiply of the model's MLP shapes (a full
  step's token budget of rows), on the engine's device, dtype and threads,
  through ``F.linear``, oneDNN's pre-packed weights and our GEMM on panels
  (``gpu/cpu_kernels/linear.py``), where they apply; the fastest.

Every kind decodes greedily and ignores EOS, and warms up on two short
requests first. Output tokens counted are the ones the workload asked for.
Every kind runs with the allocator settings our worker uses
(``host_memory.keep_freed_memory``) and its torch thread count.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import torch

from trioserve.bench.stats import percentile
from trioserve.bench.workload import BenchRequest, WorkloadSpec, build_requests, warmup_spec
from trioserve.config import EngineConfig, cpu_threads_per_worker
from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.sampling_params import SamplingParams


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _ModelOnly:
    """A closed loop of ``concurrency`` requests through scheduler and runner."""

    def __init__(self, config: EngineConfig) -> None:
        from trioserve.gpu.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        loaded = self.runner.load()
        self.runner.init_kv_cache(loaded.max_num_kv_blocks)
        self.config = config
        self.loaded = loaded
        self.cached_tokens = 0  # of the last run: tokens its requests started with from the prefix cache

    def run(
        self, requests: list[BenchRequest], concurrency: int | None
    ) -> tuple[list[tuple[int, int, float]], list[float]]:
        """``(num_tokens, num_seqs, seconds)`` of each step, and every inter-token gap
        on a clock that runs only inside ``execute()``: the ITLs of this run
        with zero overhead, defined as the bench client defines them."""
        c = self.config
        sched = Scheduler(
            num_blocks=self.loaded.max_num_kv_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=min(self.loaded.model.max_model_len, self.loaded.max_num_kv_blocks * c.block_size),
            enable_prefix_caching=c.enable_prefix_caching,
        )
        queue = deque(requests)
        limit = concurrency or len(requests)
        in_flight, clock = 0, 0.0
        steps: list[tuple[int, int, float]] = []
        itls: list[float] = []
        last: dict[str, float] = {}  # request id -> when its last token came (model clock)
        self.cached_tokens = 0
        while queue or sched.has_unfinished():
            while queue and in_flight < limit:
                r = queue.popleft()
                sched.add(Request(f"r{r.index}", r.prompt_token_ids, _params(r.max_tokens), []))
                in_flight += 1
            step = sched.schedule()
            if step is None:
                continue
            out = step.scheduled
            self.cached_tokens += sum(new.num_computed_tokens for new in out.new_requests)
            started = time.perf_counter()
            result = self.runner.execute(out)
            seconds = time.perf_counter() - started
            clock += seconds
            steps.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), seconds))
            for o in sched.postprocess(step, result):
                if o.new_token_ids:
                    if o.request_id in last:
                        n = len(o.new_token_ids)
                        itls.extend([(clock - last[o.request_id]) / n] * n)
                    last[o.request_id] = clock
                if o.finish_reason is not None:
                    in_flight -= 1
                    last.pop(o.request_id, None)
        return steps, itls


def run_model_only(config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    bench = _ModelOnly(config)
    bench.run(_warmup_requests(spec), None)
    steps, itls = bench.run(build_requests(spec), spec.concurrency)
    total = sum(s for _, _, s in steps)
    batch = spec.concurrency or config.max_num_seqs
    full = sorted(s for t, n, s in steps if t == n == batch)  # decodes only, the whole batch
    tokens = sum(r.max_tokens for r in build_requests(spec))
    return {
        "kind": "model-only",
        "seconds": total,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / total,
        "requests_per_s": spec.num_requests / total,
        "num_steps": len(steps),
        "cached_prompt_tokens": bench.cached_tokens,  # no model FLOP utilisation when > 0 (report.flops_figures)
        # The ITL this workload has with zero overhead, at our own batch shapes: compare with ITL p50.
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "decode_step_p50_s": full[len(full) // 2] if full else None,
        "decode_batch_size": batch,
        "torch_threads": torch.get_num_threads(),
    }


def _warmup_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    return build_requests(warmup_spec(spec.vocab_size))


def _load_hf(model_dir: str, attn: str | None = None, config: EngineConfig | None = None) -> Any:
    """The model as transformers loads it: at float32 on the CPU, or on the
    engine's device and dtype when ``config`` is given."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from trioserve.gpu.device import resolve_device, resolve_dtype

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    kwargs = {"attn_implementation": attn} if attn else {}
    device = resolve_device(config.device) if config is not None else torch.device("cpu")
    dtype = resolve_dtype(config.dtype, device) if config is not None else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return torch.nn.Module.to(model, device).eval()  # (transformers' own .to is typed for other uses)


def _greedy_config(max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )


def run_generate_batch(config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    model = _load_hf(config.model, config=config)  # on the engine's device, at its dtype
    requests = build_requests(spec)
    longest = max(r.max_tokens for r in requests)
    # generate_batch manages its own inference mode (wrapping it in one breaks it).
    cb_config = _cb_config(model, config, spec)
    model.generate_batch(
        inputs=[r.prompt_token_ids for r in _warmup_requests(spec)],
        generation_config=_greedy_config(4),
        continuous_batching_config=cb_config,
    )
    started = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[r.prompt_token_ids for r in requests],
        generation_config=_greedy_config(longest),
        continuous_batching_config=cb_config,
    )
    seconds = time.perf_counter() - started
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return _throughput("generate-batch", requests, seconds, generated_tokens=generated)


def _cb_config(model: Any, config: EngineConfig, spec: WorkloadSpec) -> Any:
    """The same limits as our engine: the step's token budget, at most
    ``concurrency`` sequences in a batch, and about the same KV memory (its
    default sizes the cache from free memory: gigabytes on a CPU)."""
    from transformers import ContinuousBatchingConfig

    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    page_size = 256
    elem = model.dtype.itemsize
    block_bytes = 2 * text.num_hidden_layers * page_size * kv_heads * head_dim * elem  # K and V, all layers
    in_flight = spec.concurrency or config.max_num_seqs
    needed = in_flight * -(-(spec.max_prompt_len + spec.output_len[1]) // page_size)
    # Its block's size is page_size in some transformers versions, block_size in others (5.17).
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    size: dict[str, Any] = {"page_size" if "page_size" in fields else "block_size": page_size}
    return ContinuousBatchingConfig(
        **size,
        num_blocks=max(8, min(needed, config.kv_cache_memory_bytes // block_bytes)),
        max_batch_tokens=config.max_num_batched_tokens,
        max_requests_per_batch=spec.concurrency or config.max_num_seqs,
    )


def run_generate(config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    model = _load_hf(config.model, attn="sdpa")
    requests = build_requests(spec)
    size = spec.concurrency or config.max_num_seqs
    with torch.inference_mode():
        _static_batch(model, _warmup_requests(spec))
        started = time.perf_counter()
        generated = sum(_static_batch(model, requests[i : i + size]) for i in range(0, len(requests), size))
        seconds = time.perf_counter() - started
    return _throughput("generate", requests, seconds, generated_tokens=generated, batch_size=size)


def _static_batch(model: Any, batch: list[BenchRequest]) -> int:
    """One left-padded ``generate()`` call; returns the tokens it generated."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    longest = max(r.max_tokens for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(longest))
    return (out.shape[1] - width) * len(batch)


def _throughput(kind: str, requests: list[BenchRequest], seconds: float, **extra: Any) -> dict[str, Any]:
    tokens = sum(r.max_tokens for r in requests)
    return {
        "kind": kind,
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "requests_per_s": len(requests) / seconds,
        "torch_threads": torch.get_num_threads(),
        **extra,
    }


def run_peak_gemm(config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    """The best FLOP/s of ``[rows, hidden] x [hidden, mlp]`` and its transpose
    (``rows``: the step's token budget), over half a second per path and shape."""
    import torch.nn.functional as F

    from trioserve.bench.flops import ModelShape
    from trioserve.gpu.cpu_kernels.linear import PackedLinear, PanelLinear, onednn_packs, packing_supported
    from trioserve.gpu.device import resolve_device, resolve_dtype

    shape = ModelShape.from_config(json.loads((Path(config.model) / "config.json").read_text()))
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    rows = config.max_num_batched_tokens
    best: dict[str, float] = {}
    for n_in, n_out in ((shape.hidden, shape.mlp), (shape.mlp, shape.hidden)):
        x = torch.randn(rows, n_in, device=device).to(dtype)
        linear = torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype).requires_grad_(False)
        paths = {"F.linear": lambda x=x, w=linear.weight: F.linear(x, w)}
        if packing_supported(device, dtype) and onednn_packs(dtype):
            paths["oneDNN packed"] = PackedLinear(linear)
        if packing_supported(device, dtype):
            with contextlib.suppress(Exception):  # where our kernel cannot be built, the others still measure
                paths["our GEMM (panels)"] = PanelLinear(linear)
        for name, fn in paths.items():
            rate = _best_rate(fn, x, 2 * rows * n_in * n_out, device)
            best[name] = max(best.get(name, 0.0), rate)
    path = max(best, key=best.__getitem__)
    return {"kind": "peak-gemm", "flops_per_s": best[path], "path": path, "rates": best,
            "dtype": str(dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads()}  # fmt: skip


def _best_rate(fn: Any, x: torch.Tensor, flops: int, device: torch.device, budget_s: float = 0.5) -> float:
    """The best of repeated timed calls (the least disturbed by other tenants)."""
    best = float("inf")
    with torch.inference_mode():
        fn(x)
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            fn(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
    return flops / best


KINDS = {
    "model-only": run_model_only,
    "generate-batch": run_generate_batch,
    "generate": run_generate,
    "peak-gemm": run_peak_gemm,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trioserve.bench.baselines", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--config", required=True, help="the engine's EngineConfig, as JSON")
    parser.add_argument("--spec", required=True, help="the WorkloadSpec, as JSON")
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=EngineConfig)
    spec = WorkloadSpec.from_dict(json.loads(args.spec))
    from trioserve.gpu.cpu_kernels.host_memory import keep_freed_memory

    keep_freed_memory()  # every kind gets the allocator our worker gets
    torch.set_num_threads(cpu_threads_per_worker(config))
    result = KINDS[args.kind](config, spec)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
