"""How long a stream pauses when the engine core it runs on dies and it is resumed (issue 38, item 5).

    PYTHONPATH=src python scripts/bench_resume_pause.py --model smollm2-135m --engines 1 --kills 5
    PYTHONPATH=src python scripts/bench_resume_pause.py --model smollm2-135m --engines 2 --kills 5

Starts an engine of ``--engines`` engine cores on the model, then ``--kills`` rounds: ``--streams``
greedy streams of ``--max-tokens`` tokens each start at once; once every one has ``--warm-up`` tokens, the
engine core of the last engine (``--victim worker``: its first worker) is killed with SIGKILL, and the
streams run to their end. A resumed stream's pause is what its client sees: the time from its last output
before the kill to its first output after it. Prints the pauses' p50, p99 and max over every resumed
stream of every round, beside the ordinary gap between two outputs of the same streams (p50), and how
many streams were resumed. With one engine the pause holds the restart (its backoff, a new engine core
and workers, the model loaded again); with two, the other engine takes the streams at once.

The restart budget is set so that the rounds never exhaust it, and its window (``restart_window_s``) to
one second, with a pause of two between rounds, so that every round's restart waits the first backoff
(``--restart-backoff``, the default 0.5 s), as a lone death does. ``--fake`` runs the fake runner over a
tiny model's tokenizer instead (a smoke run: no model to load).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import trio

import trioserve
from trioserve import EngineConfig, FakeRunnerConfig, SamplingParams
from trioserve.bench.stats import percentile


class Stream:
    def __init__(self, warm_up: int) -> None:
        self.arrivals: list[float] = []  # when each output came (monotonic)
        self.num_resumes = 0
        self.warm_up = warm_up
        self.warm = trio.Event()  # it has its first warm_up outputs


async def one_stream(engine: trioserve.Engine, prompt: list[int], params: SamplingParams, stream: Stream) -> None:
    async with engine.stream(prompt, params) as request:
        async for out in request:
            stream.arrivals.append(time.monotonic())
            stream.num_resumes = out.num_resumes
            if len(stream.arrivals) >= stream.warm_up:
                stream.warm.set()


async def round_(engine: trioserve.Engine, args: argparse.Namespace, first: int) -> tuple[list[float], list[float]]:
    """One kill under ``args.streams`` streams: the resumed streams' pauses, and every ordinary gap."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    streams = [Stream(args.warm_up) for _ in range(args.streams)]
    killed_at = 0.0
    async with trio.open_nursery() as nursery:
        for i, stream in enumerate(streams):
            prompt = [1, *(((first + i) * 7 + j) % 200 + 3 for j in range(15))]
            nursery.start_soon(one_stream, engine, prompt, params, stream)
        for stream in streams:
            await stream.warm.wait()
        info = engine.engine_infos[-1]
        os.kill(info.engine_pid if args.victim == "engine-core" else info.worker_pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
    pauses, gaps = [], []
    for stream in streams:
        before = [t for t in stream.arrivals if t <= killed_at]
        after = [t for t in stream.arrivals if t > killed_at]
        if stream.num_resumes and before and after:
            pauses.append(after[0] - before[-1])
        gaps += [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:], strict=False) if not a <= killed_at < b]
    return pauses, gaps


async def main(args: argparse.Namespace) -> None:
    if args.fake:
        from trioserve.gpu.tiny_models import write_tiny_model

        model = str(write_tiny_model(tempfile.mkdtemp(prefix="bench-resume-"), "llama"))
        fake = FakeRunnerConfig(step_delay_s=0.01)
    else:
        from trioserve.bench.models import resolve_model

        model, fake = str(resolve_model(args.model)), FakeRunnerConfig()
    config = EngineConfig(
        model=model, runner="fake" if args.fake else "hf", fake=fake, data_parallel_size=args.engines,
        max_num_seqs=max(args.streams, 8), max_restarts=args.kills + 2, restart_window_s=1.0,
        restart_backoff_s=args.restart_backoff, torch_threads=args.torch_threads,
    )  # fmt: skip
    pauses, gaps = [], []
    async with trioserve.open_engine(config=config) as engine:
        for k in range(args.kills):
            round_pauses, round_gaps = await round_(engine, args, k * args.streams)
            pauses += round_pauses
            gaps += round_gaps
            print(f"round {k + 1}: {len(round_pauses)} streams resumed, pauses (s): "
                  + " ".join(f"{p:.3f}" for p in sorted(round_pauses)), flush=True)  # fmt: skip
            for supervisor in engine._group.supervisors:  # every engine up again
                await supervisor.wait_health("ready")
            await trio.sleep(2.0)  # past the restart window: the next death waits the first backoff again
    if not pauses:
        raise SystemExit("no stream was resumed (they all ended before the kill: raise --max-tokens)")
    print(
        f"{args.model if not args.fake else 'fake runner'}, {args.engines} engine(s), kill -9 of the "
        f"{args.victim}: {len(pauses)} resumed streams over {args.kills} kills; pause p50 "
        f"{percentile(pauses, 50):.3f} s, p99 {percentile(pauses, 99):.3f} s, max {max(pauses):.3f} s; "
        f"ordinary gap between outputs p50 {statistics.median(gaps) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", type=int, default=1, choices=[1, 2])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--warm-up", type=int, default=8, help="tokens every stream has before the kill")
    parser.add_argument("--victim", choices=["engine-core", "worker"], default="engine-core")
    parser.add_argument(
        "--restart-backoff", type=float, default=EngineConfig.__dataclass_fields__["restart_backoff_s"].default
    )
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--fake", action="store_true", help="the fake runner (a smoke run)")
    trio.run(main, parser.parse_args())
