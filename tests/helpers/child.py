"""A child program for tests/test_process.py, run as ``python child.py MODE [ARGS]``.

Each process writes ``"<role> <pid>\\n"`` to the fd in TRIOSERVE_TEST_REPORT_FD
(inherited with pass_fds) once it is ready, so tests wait on events, not sleeps.

Modes (all but ``plain-*`` run under ``run_child_main``):
  sleep                 wait until stopped
  stuck                 block in sync code (time.sleep), deaf to stop and SIGTERM
  fail                  raise RuntimeError("boom")
  return                return at once (exit 0)
  chain N LEAF [ARGS]   supervise ``chain N-1 LEAF ARGS`` (``LEAF ARGS`` at N == 0) with grace
                        TRIOSERVE_TEST_CHAIN_GRACE (default 0.3), then wait
  chain-stuck N LEAF    the same, then block in sync code, deaf to stop and SIGTERM
  cleanup DIR           remove_if_parent_dies(DIR), then wait until stopped
  cleanup-stuck DIR     remove_if_parent_dies(DIR), then block in sync code
  env NAME              report as ``set`` or ``unset`` (NAME in the environment?), then wait
  echo                  echo every message on the socket in TRIOSERVE_TEST_SOCKET_FD
  plain-ignore-term     no parent watch; ignores SIGTERM; sleeps
  plain-default-term    no parent watch; default SIGTERM; sleeps
"""

from __future__ import annotations

import os
import signal
import sys
import time
from functools import partial
from typing import Any

import trio

from trioserve.nurseries.supervision.process import remove_if_parent_dies, run_child_main, supervise_process
from trioserve.transport.framing import MessageBridge, stream_from_fd

REPORT_FD_ENV = "TRIOSERVE_TEST_REPORT_FD"
SOCKET_FD_ENV = "TRIOSERVE_TEST_SOCKET_FD"
CHAIN_GRACE_ENV = "TRIOSERVE_TEST_CHAIN_GRACE"
IGNORE_SIGHUP_ENV = "TRIOSERVE_TEST_IGNORE_SIGHUP"  # any value: ignore SIGHUP (every mode)


def report(role: str) -> None:
    os.write(int(os.environ[REPORT_FD_ENV]), f"{role} {os.getpid()}\n".encode())


async def sleep_main() -> None:
    report("sleep")
    await trio.sleep_forever()


async def stuck_main() -> None:
    report("stuck")
    time.sleep(60)


async def fail_main() -> None:
    raise RuntimeError("boom")


async def return_main() -> None:
    report("return")


async def chain_main(depth: int, leaf: list[str], stuck: bool) -> None:
    argv = [sys.executable, __file__] + (leaf if depth == 0 else ["chain", str(depth - 1), *leaf])
    report_fd = int(os.environ[REPORT_FD_ENV])
    grace_s = float(os.environ.get(CHAIN_GRACE_ENV, "0.3"))
    name = leaf[0] if depth == 0 else f"chain-{depth - 1}"
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_process, argv, name=name, pass_fds=[report_fd], grace_s=grace_s))
        report(f"chain{depth}")
        if stuck:
            time.sleep(60)


async def cleanup_main(path: str, stuck: bool) -> None:
    remove_if_parent_dies(path)
    report("cleanup")
    if stuck:
        time.sleep(60)
    await trio.sleep_forever()


async def env_main(name: str) -> None:
    report("set" if name in os.environ else "unset")
    await trio.sleep_forever()


async def echo_main() -> None:
    stream = stream_from_fd(int(os.environ[SOCKET_FD_ENV]))
    bridge = MessageBridge(stream, receive_type=Any, name="echo")
    async with trio.open_nursery() as nursery:
        outbox, inbox = await nursery.start(bridge.run)
        report("echo")
        async with outbox:
            async for message in inbox:
                await outbox.send(message)
        await trio.sleep_forever()  # until stopped


def plain(ignore_term: bool) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report("plain")
    time.sleep(60)


def main(mode: str, *args: str) -> None:
    if IGNORE_SIGHUP_ENV in os.environ:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    mains = {"sleep": sleep_main, "stuck": stuck_main, "fail": fail_main, "return": return_main, "echo": echo_main}
    if mode in ("chain", "chain-stuck"):
        depth, leaf = int(args[0]), list(args[1:])
        run_child_main(lambda: chain_main(depth, leaf, mode == "chain-stuck"), name=f"test-chain-{depth}")
    elif mode in ("cleanup", "cleanup-stuck"):
        run_child_main(lambda: cleanup_main(args[0], mode == "cleanup-stuck"), name="test-cleanup")
    elif mode == "env":
        run_child_main(lambda: env_main(args[0]), name="test-env")
    elif mode.startswith("plain-"):
        plain(ignore_term=mode == "plain-ignore-term")
    else:
        run_child_main(mains[mode], name=f"test-{mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
