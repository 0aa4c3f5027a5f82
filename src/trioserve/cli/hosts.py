"""Engines on several hosts: ``serve``'s hosts options, ``serve
--headless`` (engine cores that join a head over TCP), and ``trioserve
keys`` (the CURVE key pair that authenticates them)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import trio

from trioserve.cli.exits import EXIT_OK
from trioserve.cli.signals import run_until_signalled
from trioserve.nurseries.headless.main import HeadlessConfig, run_headless
from trioserve.stdio import announce, say


def add_hosts_options(parser: argparse.ArgumentParser) -> None:
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


def hosts_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields of the hosts options (``serve``'s)."""
    return {
        "data_parallel_size_local": args.data_parallel_size_local,
        "data_parallel_address": args.data_parallel_address,
        "data_parallel_rpc_port": args.data_parallel_rpc_port,
        "curve_keys_dir": args.curve_keys,
        "insecure_tcp": args.insecure_tcp,
    }


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


async def _run_headless(config: HeadlessConfig) -> None:
    """The headless engine cores until SIGINT, SIGTERM or SIGHUP (then they
    are stopped and reaped), or until one fails for good."""

    async def run(_: trio.Nursery) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_headless, config)
            last = config.start_rank + config.num_engines - 1
            announce(f"trioserve: headless engine cores {config.start_rank}..{last} joining {config.handshake_address}")

    def stop(nursery: trio.Nursery) -> None:
        nursery.cancel_scope.cancel()

    await run_until_signalled(run, stop, doing="stopping")


def add_keys_parser(commands: Any) -> None:
    """``trioserve keys DIR``, in an ``add_subparsers()`` object."""
    keys = commands.add_parser(
        "keys",
        help="write a CURVE key pair for engines on several hosts",
        description="Write a new CURVE key pair into DIR (created with mode 0700; files 0600). Copy DIR to every "
        "host of the deployment and pass --curve-keys DIR to `serve` there: engine sockets on TCP then let in "
        "only peers holding this pair, and encrypt everything (docs/deployment.md).",
    )
    keys.add_argument("directory", metavar="DIR", help="where to write the key pair (must not hold one already)")
    keys.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from trioserve.transport.curve import write_keys

    keys = write_keys(args.directory)
    print(f"trioserve: wrote a CURVE key pair in {args.directory} (public key {keys.public.decode()})")
    print("copy the directory, keeping it private (mode 0700, files 0600), to every host; pass --curve-keys DIR")
    return EXIT_OK
