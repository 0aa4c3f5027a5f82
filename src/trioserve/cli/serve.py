"""``trioserve serve``: one server process, several API servers under a
supervising one (``--api-server-count``), or headless engine cores
(``--headless``, in ``cli/hosts.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trioserve.cli.engine import command_engine_config
from trioserve.cli.exits import EXIT_ERROR, EXIT_OK
from trioserve.cli.hosts import add_hosts_options, cmd_headless, hosts_fields
from trioserve.cli.server_options import add_server_options, server_config
from trioserve.cli.signals import run_until_signalled
from trioserve.engine_options import add_engine_options
from trioserve.errors import collapse
from trioserve.server import Server
from trioserve.server.api_servers.supervisor import MAX_API_SERVERS, ApiServers
from trioserve.server.listener import fds_needed, raise_fd_limit
from trioserve.server.server import model_name
from trioserve.stdio import announce, say


def add_serve_parser(commands: Any) -> None:
    """``trioserve serve``, in an ``add_subparsers()`` object."""
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API and WebSocket",
        description="Start an engine and serve it on one port: the OpenAI-compatible HTTP API under /v1 "
        "(docs/openai-api.md), WebSocket token streaming (docs/websocket-protocol.md), Prometheus /metrics "
        "(docs/metrics.md). Prints the URLs once the model is loaded; GET /health on the same port answers 200 "
        "when ready. SIGINT (Ctrl-C), SIGTERM or SIGHUP shuts down gracefully.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as vllm serve takes it: a model directory, a .gguf file, or a Hugging Face id found in the "
        "local Hugging Face cache (or downloaded); the same as --model (default: the built-in model)",
    )
    add_server_options(serve)
    # --seed: vLLM's (serve has no request seed of its own); INFO: a server's log says what happens, when.
    add_engine_options(serve, seed_flags=("--engine-seed", "--seed"), log_level="INFO")
    add_hosts_options(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.headless:
        return cmd_headless(args)
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"--api-server-count: must be in [1, {MAX_API_SERVERS}]")
    config = server_config(args)  # its errors come before any model is built
    engine_config = command_engine_config(args, **hosts_fields(args))
    if args.api_server_count > 1:
        servers = ApiServers(engine_config, config, args.api_server_count)
        raise_fd_limit(fds_needed(config.max_connections))  # inherited by the API servers
        return _until_stopped(args, _serve_api_servers, servers)
    server = Server(engine_config, config)
    raise_fd_limit(fds_needed(config.max_connections))  # the process is ours
    return _until_stopped(args, _serve, server)


def _until_stopped(args: argparse.Namespace, serve: Callable[[Any], Awaitable[None]], what: object) -> int:
    """``trio.run(serve, what)``: exit 0 once it stopped, 1 when it could not listen."""
    try:
        try:
            trio.run(serve, what)
        except BaseExceptionGroup as group:  # the listening socket is opened in a nursery
            raise collapse(group) from None
    except OSError as exc:  # the address is taken, or not ours
        say(f"trioserve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        return EXIT_ERROR
    say("trioserve: stopped")
    return EXIT_OK


async def _serve(server: Server) -> None:
    """Run ``server`` until SIGINT, SIGTERM or SIGHUP has shut it down
    gracefully (a second signal ends the grace at once). Raises what
    ``Server.run`` raises."""

    async def run(nursery: trio.Nursery) -> None:
        nursery.start_soon(_announce_when_ready, server)
        await server.run()

    await run_until_signalled(run, lambda _: server.shutdown(), doing="shutting down")


async def _announce_when_ready(server: Server) -> None:
    if await server.wait_ready():
        announce(
            f"trioserve: serving on {server.url} (health: {server.health_url}, "
            f"OpenAI API: {server.http_url}, model {server.api.model_name!r})"
        )


async def _serve_api_servers(servers: ApiServers) -> None:
    """The supervising process of several API servers, until SIGINT, SIGTERM
    or SIGHUP (then every process is stopped and reaped): once they serve, they drain
    first; while they start (engines loading, or waiting for one on another
    host), everything stops at once. Raises what ``ApiServers.run`` raises."""
    serving = trio.Event()

    async def run(_: trio.Nursery) -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(servers.run)
            host = servers.server_config.host
            host = f"[{host}]" if ":" in host else host
            name = servers.server_config.model_name or model_name(servers.engine_config)
            tls = servers.server_config.ssl_certfile is not None
            ws, web = ("wss", "https") if tls else ("ws", "http")
            announce(
                f"trioserve: serving on {ws}://{host}:{port} (health: {web}://{host}:{port}/health, "
                f"OpenAI API: {web}://{host}:{port}/v1, model {name!r}; {servers.count} API servers, "
                f"pids {', '.join(str(pid) for pid in servers.pids)})"
            )
            serving.set()

    def drain(nursery: trio.Nursery) -> None:
        if not serving.is_set():  # still starting: nothing to drain
            nursery.cancel_scope.cancel()
            return
        first = not servers.draining
        servers.drain()  # again: the API servers end their grace at once
        if first:
            nursery.start_soon(_stop_when_drained, servers, nursery.cancel_scope)

    await run_until_signalled(run, drain, doing="shutting down")


async def _stop_when_drained(servers: ApiServers, scope: trio.CancelScope) -> None:
    """Once every API server has drained (at most its grace and close time,
    and a margin), stop the engines and everything else."""
    config = servers.server_config
    with trio.move_on_after(config.shutdown_grace_s + config.close_timeout_s + 5):
        await servers.wait_drained()
    scope.cancel()
