"""The ``trioserve bench`` subcommand: ``add_bench_parser(subparsers)``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import stat
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from trio_websocket import HandshakeError

from trioserve.bench.drivers import Progress
from trioserve.bench.embed import run_embed_bench
from trioserve.bench.models import BENCH_MODELS, REAL_MODELS, resolve_model
from trioserve.bench.openai_driver import first_model, models_url
from trioserve.bench.report import (
    build_result,
    engine_baseline,
    engine_figures,
    flops_figures,
    flops_targets,
    format_table,
    plot_latencies,
    write_json,
)
from trioserve.bench.run import (
    BASELINE_KINDS,
    OPTIONAL_BASELINE_KINDS,
    run_against_openai,
    run_against_server,
    run_baseline,
    run_in_process,
)
from trioserve.bench.stats import run_window, summarize
from trioserve.bench.steps import in_run_figures
from trioserve.bench.vllm_baseline import run_vllm
from trioserve.bench.workload import (
    MAX_ARRIVAL_SPAN_S,
    MAX_NUM_REQUESTS,
    MAX_PROMPT_TOKENS,
    WorkloadSpec,
    parse_range,
)
from trioserve.config import EngineConfig
from trioserve.engine_options import add_engine_options, engine_config
from trioserve.errors import StoppedBySignal, collapse
from trioserve.nurseries.supervision.oneshot import until_stop_signal
from trioserve.pooling import engine_pooling
from trioserve.stdio import say

DEFAULT_MODEL = "bench-llama-40m"
MAX_ROUNDS = 100
_T = TypeVar("_T")

DESCRIPTION = """\
Measure trioserve's throughput and latency, and the same workload's baselines
in the same run. Sends NUM_REQUESTS requests of random token-id prompts
(greedy, EOS ignored, so every request produces exactly its output length)
to an in-process engine, or with --url to a running server (`trioserve serve` over WebSocket, or any
OpenAI-compatible server, vLLM's too, over HTTP); then
runs each baseline in its own process: the model-only bound (our model
runner stepping the same batch shapes, no scheduling, IPC or
detokenization), transformers' generate_batch (continuous batching) and
transformers' generate() in static batches of --concurrency.

Prints requests/s, output tokens/s, time to first token, inter-token and
end-to-end latency (p50/p99), the peak memory of each process, the prefix
cache's hit rate, and our throughput as a ratio of each baseline's. Example
(the issue 5 run):

  trioserve bench --num-requests 256 --concurrency 32 --prompt-len 32-256 --output-len 64

Two more baselines run only when asked: no-prefix-caching (our engine again,
with prefix caching off) and vllm (vLLM's offline engine, in the interpreter
of its own virtual environment given by --vllm-python). With a shared prefix
(the issue 15 run):

  trioserve bench --shared-prefix-len 1024 --num-requests 128 \
      --baselines no-prefix-caching,vllm --vllm-python /tmp/vllm-venv/bin/python
"""


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to an ``add_subparsers()`` object; returns its parser."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark throughput and latency against baselines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_options(parser)
    _add_target_options(parser)
    add_engine_options(
        parser,
        model_default=DEFAULT_MODEL,
        model_metavar="NAME|DIR|GGUF|HF-ID",
        model_help="a model directory, a .gguf file, a Hugging Face id (as serve takes them), or a named "
        f"benchmark model built on first use: {', '.join([*BENCH_MODELS, *REAL_MODELS])} (default: "
        "%(default)s). With --url, the model the server "
        "runs (for the prompts' vocabulary and the baselines)",
        threads_help="torch threads of the engine's worker and of every baseline (default: as serve's)",
    )
    _add_output_options(parser)
    parser.set_defaults(func=cmd_bench)
    return parser


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--num-requests", type=int, default=256, metavar="N", help=f"at most {MAX_NUM_REQUESTS} (default: %(default)s)"
    )
    group.add_argument(
        "--concurrency",
        type=int,
        default=32,
        metavar="C",
        help="most requests in flight; 0 for no limit (default: %(default)s)",
    )
    group.add_argument(
        "--request-rate",
        type=float,
        default=None,
        metavar="R",
        help="send requests as a Poisson process of R per second (default: all at once, within --concurrency)",
    )
    group.add_argument("--prompt-len", default="32-256", metavar="N|LO-HI", help="prompt tokens (default: %(default)s)")
    group.add_argument("--output-len", default="64", metavar="N|LO-HI", help="output tokens (default: %(default)s)")
    group.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with the same N random tokens, then its own --prompt-len (default: %(default)s)",
    )
    group.add_argument("--seed", type=int, default=0, help="the workload depends only on this (default: %(default)s)")


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what to benchmark")
    group.add_argument(
        "--url",
        help="drive a running server instead of an in-process engine: `trioserve serve` at its ws:// URL (the "
        "WebSocket protocol), or any OpenAI-compatible server (trioserve's, `vllm serve`) at its http:// URL "
        "(streamed /v1/completions)",
    )
    group.add_argument("--api-key", default=None, help="the server's API key, if it wants one")
    group.add_argument(
        "--baselines",
        default=",".join(BASELINE_KINDS),
        metavar="LIST",
        help="comma-separated, from %(default)s, and the optional "
        f"{', '.join(OPTIONAL_BASELINE_KINDS)}; 'none' for none (default: %(default)s)",
    )
    group.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the Python interpreter of a virtual environment with vLLM, for --baselines vllm",
    )
    group.add_argument(
        "--baseline-timeout", type=float, default=1800, metavar="SECONDS", help="per baseline (default: %(default)s)"
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="an embedding model only: trioserve and sentence-transformers take turns R times; the ratio is "
        "the median round's (default: %(default)s)",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    group.add_argument("--plot", metavar="FILE.png", help="draw the latency distributions (needs matplotlib)")
    group.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The text model's part of ``model_dir/config.json``. ``ValueError``
    naming the file when it cannot be read or has no ``vocab_size``."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    text = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(text, dict) or not isinstance(text.get("vocab_size"), int):
        raise ValueError(f"model: {path} has no vocab_size")
    return text


def _context(args: argparse.Namespace, config: EngineConfig, text_config: dict[str, Any]) -> tuple[int, str] | None:
    """The most tokens a request may hold, prompt and output, and where that
    limit comes from: in process, ``--max-model-len`` when it is below the
    model's own, which is the fake runner's ``max_model_len``, else the
    model's ``max_position_embeddings`` (``n_positions``: GPT-2); with
    ``--url``, the server's own (``server_context``) when it says; None when
    nothing gives one. (An in-process engine may cap it lower still, to what
    its KV cache holds.)"""
    if args.url:
        served = server_context(args.url, args.api_key)
        if served is not None:
            return served, f"max_model_len at {models_url(args.url)}"
        return _positions(config, text_config)
    if config.runner == "fake":
        own: tuple[int, str] | None = (config.fake.max_model_len, "the fake runner's max_model_len")
    else:
        own = _positions(config, text_config)
    if config.max_model_len is not None and (own is None or config.max_model_len < own[0]):
        return config.max_model_len, "--max-model-len"
    return own


def _positions(config: EngineConfig, text_config: dict[str, Any]) -> tuple[int, str] | None:
    """The model's own context length, from its ``config.json``."""
    for key in ("max_position_embeddings", "n_positions"):
        value = text_config.get(key)
        if isinstance(value, int):
            return value, f"{key} in {config.model}/config.json"
    return None


def _driver(url: str | None) -> str:
    """How the run reached the engine, as the table and the JSON say it."""
    if not url:
        return "in-process engine"
    return f"OpenAI API {url}" if url.startswith(("http://", "https://")) else f"WebSocket {url}"


def server_context(url: str, api_key: str | None) -> int | None:
    """The ``max_model_len`` the server at ``url`` serves, from its
    ``GET /v1/models``; None when it cannot be read (the run then says
    whether the server can be reached at all)."""
    try:
        value = first_model(url, api_key, timeout_s=5)["max_model_len"]
    except (ValueError, KeyError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _check_fits(spec: WorkloadSpec, context: tuple[int, str] | None) -> None:
    """``ValueError`` naming the options when the longest request of ``spec``
    (prompt and output) exceeds ``context``: it could only fail."""
    if context is None or spec.max_request_len <= context[0]:
        return
    parts = [f"--prompt-len up to {spec.prompt_len[1]}", f"--output-len up to {spec.output_len[1]}"]
    if spec.shared_prefix_len:
        parts.insert(0, f"--shared-prefix-len {spec.shared_prefix_len}")
    raise ValueError(
        f"a request of {' + '.join(parts)} = {spec.max_request_len} tokens does not fit the model's context "
        f"of {context[0]} tokens ({context[1]})"
    )


def _check_size(spec: WorkloadSpec) -> None:
    """``ValueError`` naming the options when ``spec``'s prompts could not all
    be built in memory, or its requests would take more than a day to arrive."""
    most = spec.num_requests * spec.max_prompt_len
    if most > MAX_PROMPT_TOKENS:
        prompt = "--shared-prefix-len + --prompt-len" if spec.shared_prefix_len else "--prompt-len"
        raise ValueError(
            f"--num-requests {spec.num_requests} x prompts of up to {spec.max_prompt_len} tokens ({prompt}) = "
            f"{most} prompt tokens: at most {MAX_PROMPT_TOKENS} (every prompt is built before the run)"
        )
    if spec.request_rate is not None and (span := (spec.num_requests - 1) / spec.request_rate) > MAX_ARRIVAL_SPAN_S:
        raise ValueError(
            f"--request-rate {spec.request_rate:g}: {spec.num_requests} requests would take about {span:.3g} s "
            f"to arrive, more than a day"
        )


def _workload(args: argparse.Namespace, text_config: dict[str, Any]) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=parse_range(args.prompt_len, "--prompt-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        vocab_size=text_config["vocab_size"],
        seed=args.seed,
        concurrency=args.concurrency or None,
        request_rate=args.request_rate,
        shared_prefix_len=args.shared_prefix_len,
    )


def _baseline_kinds(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    known = BASELINE_KINDS + OPTIONAL_BASELINE_KINDS
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ValueError(f"baselines: unknown {unknown[0]!r} (choose from {', '.join(known)}, or none)")
    return kinds


def _describe(spec: WorkloadSpec) -> str:
    def rng(lo_hi: tuple[int, int]) -> str:
        return str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}-{lo_hi[1]}"

    pacing = f"concurrency {spec.concurrency or 'unlimited'}"
    if spec.request_rate:
        pacing += f", {spec.request_rate:g} req/s Poisson"
    shared = f"a shared prefix of {spec.shared_prefix_len} + " if spec.shared_prefix_len else ""
    return (
        f"{spec.num_requests} requests, {pacing}, prompts {shared}{rng(spec.prompt_len)} tokens, "
        f"outputs {rng(spec.output_len)} tokens, seed {spec.seed}"
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """What would fail only after the run (its figures lost) fails now: a
    ``--json`` or ``--plot`` file that cannot be written, ``--plot`` without
    matplotlib, a ``--url`` that is not a WebSocket URL."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            _check_writable(option, path)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'trioserve[bench]' (or matplotlib)")
    if args.url and not args.url.startswith(("ws://", "wss://", "http://", "https://")):
        raise ValueError(
            f"--url: {args.url!r:.80} is neither a WebSocket URL (ws://HOST:PORT, as `trioserve serve` prints) nor "
            "an OpenAI API's (http://HOST:PORT)"
        )


def _check_writable(option: str, path: str) -> None:
    """``ValueError`` naming ``option`` and ``path`` unless a file can be
    written there: ``path`` is not a directory, nor too long, nor under a
    file, and its directory is one this user can write."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:  # as it should be, or its directory is missing (said below)
        is_dir = False
    except OSError as exc:  # too long, under a file, a loop of links
        raise ValueError(f"{option}: cannot write {path}: {exc.strerror or exc}") from None
    if is_dir:
        raise ValueError(f"{option}: cannot write {path}: it is a directory")
    directory = Path(path).parent
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise ValueError(f"{option}: cannot write {path}: {directory} is not a directory this user can write")


def cmd_bench(args: argparse.Namespace) -> int:
    kinds = _baseline_kinds(args.baselines)
    if "vllm" in kinds and not args.vllm_python:
        raise ValueError("baselines: vllm needs --vllm-python PATH (a virtual environment with vLLM)")
    _check_outputs(args)
    if not 1 <= args.num_requests <= MAX_NUM_REQUESTS:
        raise ValueError(f"--num-requests: must be in [1, {MAX_NUM_REQUESTS}] (got {args.num_requests})")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds: must be in [1, {MAX_ROUNDS}] (got {args.rounds})")
    model_dir = resolve_model(args.model)
    config = engine_config(args, str(model_dir))
    text_config = _text_config(model_dir)
    if engine_pooling(config) is not None:  # an embedding model: inputs per second (bench/embed.py)
        if args.url:
            raise ValueError("--url: an embedding model is measured in-process only (bench/embed.py)")
        context = min(config.max_model_len or 1 << 30, int(text_config.get("max_position_embeddings", 512)))
        return run_embed_bench(args, config, model_dir, context)
    if args.rounds != 1:
        raise ValueError("--rounds: for an embedding model only (a generation benchmark runs once)")
    spec = _workload(args, text_config)
    _check_fits(spec, _context(args, config, text_config))
    _check_size(spec)
    progress = Progress(spec.num_requests, enabled=not args.no_progress)
    say(f"trioserve bench: {_describe(spec)}")
    peak = run_baseline("peak-gemm", config, spec, args.baseline_timeout) if config.runner == "hf" else None
    if args.url:
        try:
            drive = run_against_openai if args.url.startswith("http") else run_against_server
            outcome = _stoppable(drive, args.url, args.api_key, spec, progress)
        except (OSError, HandshakeError, BaseExceptionGroup) as exc:
            cause = collapse(exc) if isinstance(exc, BaseExceptionGroup) else exc
            if not isinstance(cause, OSError | HandshakeError):
                raise
            underlying = cause.__cause__ or cause.__context__ or cause  # a HandshakeError says nothing itself
            why = getattr(underlying, "strerror", None) or str(underlying) or type(underlying).__name__
            raise ValueError(f"--url: cannot reach a server at {args.url}: {why}") from None
    else:
        outcome = _stoppable(run_in_process, config, spec, progress)
    baselines = {}
    for kind in kinds if config.runner == "hf" else []:
        say(f"trioserve bench: baseline {kind} ...")
        baselines[kind] = _run_baseline(kind, args, config, spec)
    meta = {
        "driver": _driver(args.url),
        "model": str(model_dir),
        "workload": spec.to_dict(),
        "workload_text": _describe(spec),
        "engine_config": {k: v for k, v in vars(config).items() if k != "fake"},
    }
    in_run = in_run_figures(outcome.steps, *run_window(outcome.records))
    run = summarize(outcome.records)
    if len(outcome.requests_per_engine) > 1:
        run["requests_per_engine"] = outcome.requests_per_engine
    if outcome.engine_stats is not None:
        run["engine"] = engine_figures(outcome.engine_stats)
    if outcome.cpu_seconds:
        run["cpu_seconds"] = outcome.cpu_seconds
    result = build_result(run, outcome.peak_rss_bytes, baselines, meta, in_run)
    if peak is not None:
        result["model_flops"] = flops_figures(model_dir, spec, peak, run, baselines)
        result["targets"] |= flops_targets(result["model_flops"])
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        ours = f"trioserve at {args.url}" if args.url else "trioserve (in-process engine)"
        plot_latencies(outcome.records, args.plot, f"trioserve bench: {_describe(spec)}", baselines, ours)
    return 1 if result["results"]["num_errors"] else 0


def _stoppable(run: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``trio.run(run, *args)``, which a SIGTERM or SIGHUP cancels, so that
    the engine it started stops in order, its processes reaped; then
    ``StoppedBySignal``."""
    result: list[_T] = []

    async def main() -> None:
        result.append(await run(*args))

    if (signum := trio.run(until_stop_signal, main)) is not None:
        raise StoppedBySignal(signum, "stopped the benchmark run before it finished (nothing reported)")
    return result[0]


def _run_baseline(kind: str, args: argparse.Namespace, config: EngineConfig, spec: WorkloadSpec) -> dict[str, Any]:
    if kind == "vllm":
        return run_vllm(args.vllm_python, config, spec, args.baseline_timeout)
    if kind == "no-prefix-caching":
        progress = Progress(spec.num_requests, enabled=not args.no_progress)
        outcome = _stoppable(run_in_process, config.replace(enable_prefix_caching=False), spec, progress)
        return engine_baseline(kind, summarize(outcome.records))
    return run_baseline(kind, config, spec, args.baseline_timeout)


def main(argv: list[str] | None = None) -> int:
    """``python -m trioserve.bench.cli ...``: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="trioserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        try:
            return args.func(args)
        except BaseExceptionGroup as group:  # from the run's nursery (_stoppable), as the trioserve command does
            raise collapse(group) from None
    except ValueError as exc:
        say(f"trioserve: invalid input: {exc}")
        return 2
    except StoppedBySignal as exc:  # as the trioserve command says it
        say(f"trioserve: {exc}")
        return 128 + exc.signum


if __name__ == "__main__":
    from trioserve.stdio import ensure_standard_fds

    ensure_standard_fds()  # as the trioserve command does
    sys.exit(main())
