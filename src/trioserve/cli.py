"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import trio

from trioserve.api import open_engine
from trioserve.bench.cli import add_bench_parser
from trioserve.config import EngineConfig
from trioserve.errors import TrioserveError
from trioserve.messages import SamplingParams
from trioserve.server import Server, ServerConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model directory (config.json, weights, tokenizer.json). "
        "Default: a tiny built-in model with random weights, made on first use.",
    )
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: %(default)s")
    group.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="default: %(default)s"
    )
    group.add_argument(
        "--kv-cache-mib", type=int, default=512, metavar="MIB", help="memory for the KV cache (default: %(default)s)"
    )
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in a batch (default: %(default)s)")
    group.add_argument(
        "--max-model-len", type=int, default=None, help="context length cap (default: the model's own)"
    )
    group.add_argument("--runner", choices=["hf", "fake"], default="hf", help=argparse.SUPPRESS)
    group.add_argument("--log-level", default="WARNING", help="logging level (default: %(default)s)")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one (default: off)")
    group.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model is None:
        from trioserve.default_model import default_model_dir

        model = str(default_model_dir())
    else:
        model = args.model
    return EngineConfig(
        model=model,
        runner=args.runner,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024 * 1024,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


async def _generate(config: EngineConfig, prompt: str, params: SamplingParams) -> None:
    async with open_engine(config=config) as engine:
        started = time.perf_counter()
        final = None
        async with engine.stream(prompt, params) as stream:
            async for out in stream:
                sys.stdout.write(out.text)
                sys.stdout.flush()
                final = out
        elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    assert final is not None
    print(
        f"[{final.num_output_tokens} tokens in {elapsed:.2f}s, finish reason: {final.finish_reason}]",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    config = _engine_config(args)
    params = _sampling_params(args)
    trio.run(_generate, config, args.prompt, params)
    return 0


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host", default=defaults.host,
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 for every interface)",
    )
    group.add_argument("--port", type=int, default=defaults.port, help="TCP port; 0 picks a free one (default: %(default)s)")
    group.add_argument(
        "--api-key", default=os.environ.get("TRIOSERVE_API_KEY"), metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every WebSocket handshake "
        "(default: $TRIOSERVE_API_KEY, else no key)",
    )
    group.add_argument(
        "--max-requests-per-connection", type=int, default=defaults.max_requests_per_connection, metavar="N",
        help="requests one connection may have in flight (default: %(default)s)",
    )
    group.add_argument(
        "--max-message-bytes", type=int, default=defaults.max_message_bytes, metavar="BYTES",
        help="a larger client message closes its connection with code 1009 (default: %(default)s)",
    )
    group.add_argument(
        "--slow-consumer-timeout", type=float, default=defaults.slow_consumer_timeout_s, metavar="SECONDS",
        help="end a client's requests when it reads nothing for this long (default: %(default)s)",
    )
    group.add_argument(
        "--shutdown-grace", type=float, default=defaults.shutdown_grace_s, metavar="SECONDS",
        help="on SIGINT/SIGTERM, time for requests in flight to finish (default: %(default)s)",
    )


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_requests_per_connection=args.max_requests_per_connection,
        max_message_bytes=args.max_message_bytes,
        slow_consumer_timeout_s=args.slow_consumer_timeout,
        shutdown_grace_s=args.shutdown_grace,
    )


async def _serve(server: Server) -> None:
    """Run ``server`` until SIGINT or SIGTERM has shut it down gracefully (a
    second signal ends the grace at once). Raises what ``Server.run`` raises."""
    failure: list[Exception] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signals() -> None:
                async for signum in signals:
                    print(f"trioserve: {signal.Signals(signum).name}: shutting down", file=sys.stderr, flush=True)
                    server.shutdown()

            async def announce() -> None:
                if await server.wait_ready():
                    print(f"trioserve: serving on {server.url} (health: {server.health_url})", flush=True)

            async def run_server() -> None:
                try:
                    await server.run()
                except (TrioserveError, OSError) as exc:  # OSError: cannot listen
                    failure.append(exc)
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signals)
            nursery.start_soon(announce)
            nursery.start_soon(run_server)
    if failure:
        raise failure[0]


def cmd_serve(args: argparse.Namespace) -> int:
    server = Server(_engine_config(args), _server_config(args))
    try:
        trio.run(_serve, server)
    except OSError as exc:  # the address is taken, or not ours
        print(f"trioserve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print("trioserve: stopped", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trioserve",
        description="Serve large language models with continuous batching, on Trio.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate = commands.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Start an engine, stream the completion of PROMPT to stdout, then stop the engine.",
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the text to complete")
    _add_engine_options(generate)
    _add_sampling_options(generate)
    generate.set_defaults(func=cmd_generate)
    serve = commands.add_parser(
        "serve",
        help="serve a model to WebSocket clients that stream tokens",
        description="Start an engine and stream tokens to WebSocket clients (protocol: docs/websocket-protocol.md). "
        "Prints the URL once the model is loaded; GET /health on the same port answers 200 when ready. "
        "SIGINT (Ctrl-C) or SIGTERM shuts down gracefully.",
    )
    _add_server_options(serve)
    _add_engine_options(serve)
    serve.set_defaults(func=cmd_serve)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TRIOSERVE_LOG_LEVEL", args.log_level.upper())
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"trioserve: invalid input: {exc}", file=sys.stderr)
        return 2
    except TrioserveError as exc:
        print(f"trioserve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntrioserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
