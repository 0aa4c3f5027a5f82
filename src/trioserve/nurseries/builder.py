"""A one-shot program, a model builder, run as a supervised child.

The default model's conversion and the tiny and benchmark models' builds
write a model directory once, in a process of their own (the front-end never
imports torch). ``run_builder`` starts ``python -m trioserve.nurseries.entry
build MODULE ARG... OUT_DIR``, which calls ``MODULE.main([ARG..., OUT_DIR])``
in a thread under ``run_child_main``, and waits for it. So the build is a
child like any other:

- if the parent dies (SIGKILL included), the builder removes ``OUT_DIR``'s
  parent, the scratch directory the parent made for it, and exits: nothing
  half-built and no converter outlive a killed ``trioserve serve``;
- SIGINT in the parent (Ctrl-C) and SIGTERM stop the builder, wait for it to
  be reaped, then raise ``KeyboardInterrupt`` and ``StoppedBySignal``.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
from pathlib import Path

import trio

from trioserve.errors import StoppedBySignal, collapse
from trioserve.nurseries.child_main import ChildFailed, remove_if_parent_dies
from trioserve.nurseries.process import ChildProcess, supervise_process

# After a stop the builder's Trio side abandons the build's thread and exits;
# its hard exit (1.5 s) and reaping (0.5 s) fit inside this grace.
BUILDER_GRACE_S = 3.0


def run_builder(module: str, args: list[str], *, name: str) -> int:
    """Run ``module.main(args)`` in a supervised child and return its exit
    code (0: built). Blocking: call it outside Trio. In the main thread, a
    SIGTERM stops the child and raises ``StoppedBySignal``; a SIGINT does
    the same and raises ``KeyboardInterrupt``."""
    argv = [sys.executable, "-m", "trioserve.nurseries.entry", "build", module, *args]
    try:
        return trio.run(_run, argv, name)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


async def _run(argv: list[str], name: str) -> int:
    terminated = False
    async with trio.open_nursery() as nursery:

        async def stop_on_sigterm(*, task_status: trio.TaskStatus[None]) -> None:
            nonlocal terminated
            if threading.current_thread() is not threading.main_thread():
                task_status.started()  # signals reach only the main thread's handlers
                return
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                task_status.started()
                async for _ in signals:
                    terminated = True
                    nursery.cancel_scope.cancel()  # supervise_process stops the builder and reaps it
                    return

        async def supervise(*, task_status: trio.TaskStatus[ChildProcess]) -> None:
            await supervise_process(argv, name=name, grace_s=BUILDER_GRACE_S, task_status=task_status)
            nursery.cancel_scope.cancel()  # built (or failed): stop listening for signals

        await nursery.start(stop_on_sigterm)
        child: ChildProcess = await nursery.start(supervise)
        child.expect_exit()  # it ends by itself: any exit code is an answer, not a failure
    if terminated:
        raise StoppedBySignal(f"SIGTERM: stopped the {name} before it finished (nothing kept)")
    assert child.returncode is not None
    return child.returncode


async def builder_main(argv: list[str]) -> None:
    """The child: ``argv`` is ``MODULE ARG... OUT_DIR``. Raises ``ChildFailed``
    (exit 1, one line) when the module's ``main`` exits with a non-zero code;
    anything it raises ends the child with its traceback."""
    if len(argv) < 2 or not argv[0].startswith("trioserve."):
        raise ChildFailed(f"build: expected a trioserve module and its arguments, got {argv!r}")
    module, args = argv[0], argv[1:]
    remove_if_parent_dies(Path(args[-1]).parent)
    # Builders print the directory they wrote; the parent's stdout is not for that.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    # Abandoned when the parent stops us: the process then exits without waiting for the build.
    code = await trio.to_thread.run_sync(functools.partial(_call_main, module, args), abandon_on_cancel=True)
    if code != 0:
        raise ChildFailed(f"{module} exited with code {code}")


def _call_main(module: str, args: list[str]) -> int:
    """``module.main(args)`` as ``python -m module`` would end it: its exit code."""
    try:
        importlib.import_module(module).main(args)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0
