"""A/B of runner settings over a whole bench workload, in one process: the
model-only loop of ``trioserve bench`` (our scheduler, no IPC) drives every
runner with the same scheduler outputs, step by step, alternating their
order each step, and times each one's ``execute()``::

    PYTHONPATH=src python scripts/ab_workload.py --model smollm2-135m --torch-threads 1 \
        --settings all-kernel,all,compile --num-requests 64

Settings as in ``ab_step.py``. Greedy decoding with EOS ignored gives every
runner the same batch shapes; the first setting's outputs drive the loop.
Prints each setting's time in decode-only steps and in steps with prefill
tokens, and the first setting's time over each one's.
"""

from __future__ import annotations

import argparse
import json
import time

from ab_step import make_runner
from trioserve.bench.baselines import _ModelOnly, _warmup_requests
from trioserve.bench.models import resolve_model
from trioserve.bench.workload import WorkloadSpec, build_requests, parse_range
from trioserve.config import EngineConfig
from trioserve.gpu.model_runner import ModelRunner
from trioserve.messages import ModelInfo, RunnerOutput, SchedulerOutput, WorkerLoaded


class Tee:
    """Runs every runner on each step; answers with the first one's output."""

    def __init__(self, runners: dict[str, ModelRunner]) -> None:
        self.runners = runners
        self.times: dict[str, list[tuple[bool, float]]] = {s: [] for s in runners}
        self.flip = False

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        decode_only = sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens)
        outputs = {}
        order = list(self.runners)
        for s in reversed(order) if self.flip else order:
            started = time.perf_counter()
            outputs[s] = self.runners[s].execute(sched)
            self.times[s].append((decode_only, time.perf_counter() - started))
        self.flip = not self.flip
        return outputs[order[0]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--settings", default="all,compile")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", default="32-256")
    p.add_argument("--output-len", default="64")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with (prefix caching)")
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    settings = args.settings.split(",")
    runners = {s: make_runner(str(model_dir), args.torch_threads, "float32", s) for s in settings}
    config = EngineConfig(model=str(model_dir), max_num_seqs=args.concurrency, torch_threads=args.torch_threads)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    spec = WorkloadSpec(
        num_requests=args.num_requests, prompt_len=parse_range(args.prompt_len),
        output_len=parse_range(args.output_len), vocab_size=vocab, seed=0, concurrency=args.concurrency,
        shared_prefix_len=args.shared_prefix_len,
    )  # fmt: skip
    bench = _ModelOnly.__new__(_ModelOnly)  # its loop, over our runners (each with 1200 blocks)
    tee = Tee(runners)
    bench.runner, bench.config = tee, config  # type: ignore[assignment]
    info = ModelInfo(vocab_size=vocab, max_model_len=4096, eos_token_ids=[])
    bench.loaded = WorkerLoaded(model=info, max_num_kv_blocks=1200)
    bench.run(_warmup_requests(spec), None)
    tee.times = {s: [] for s in settings}
    bench.run(build_requests(spec), spec.concurrency)
    first = settings[0]
    for s in settings:
        decode = sum(t for d, t in tee.times[s] if d)
        prefill = sum(t for d, t in tee.times[s] if not d)
        base_d = sum(t for d, t in tee.times[first] if d)
        base_p = sum(t for d, t in tee.times[first] if not d)
        print(
            f"{s}: decode-only steps {decode:.1f} s, with prefill {prefill:.1f} s, total {decode + prefill:.1f} s; "
            f"{first}/{s}: decode {base_d / decode:.2f}x, prefill {base_p / prefill:.2f}x, "
            f"total {(base_d + base_p) / (decode + prefill):.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
