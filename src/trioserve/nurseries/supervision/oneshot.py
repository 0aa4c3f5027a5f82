"""A one-shot program (a model builder, a benchmark baseline) run as a
supervised child.

The default model's conversion, the tiny and benchmark models' builds and
the benchmark's baselines each run once, in a process of their own (the
front-end never imports torch). ``run_oneshot`` starts ``python -m
trioserve.nurseries.supervision.entry run MODULE ARG...``, which calls
``MODULE.main([ARG...])`` in a thread under ``run_child_main``, and waits
for it. So it is a child like any other:

- if the parent dies (SIGKILL included), it stops at once, and first removes
  its ``scratch`` directory if it was given one (a model half built);
- SIGINT in the parent (Ctrl-C), and SIGTERM or SIGHUP (a terminal closed),
  stop it, wait for it to be reaped, then raise ``KeyboardInterrupt`` and
  ``StoppedBySignal``; so does the end of its time limit, which returns as
  ``timed_out``. The first such signal is the one taken: those that follow
  are ignored, so that the stop runs its course (the caller removes what the
  child half built) whatever the user presses meanwhile.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

from trioserve.errors import StoppedBySignal, collapse, describe
from trioserve.nurseries.supervision.child_main import ChildFailed, remove_if_parent_dies
from trioserve.nurseries.supervision.process import ChildProcess, python_argv, supervise_process

# After a stop the child's Trio side abandons the program's thread and exits;
# its hard exit (1.5 s) and reaping (0.5 s) fit inside this grace.
ONESHOT_GRACE_S = 3.0
SCRATCH_ENV = "TRIOSERVE_ONESHOT_SCRATCH"  # removed by the child if its parent dies


@dataclass(frozen=True)
class Finished:
    """How a one-shot program ended: its exit code (None when its time limit
    stopped it) and, when captured, what it wrote."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


def run_oneshot(
    module: str,
    args: list[str],
    *,
    name: str,
    scratch: Path | None = None,
    capture: bool = False,
    quiet: bool = False,
    timeout_s: float | None = None,
) -> Finished:
    """Run ``module.main(args)`` in a supervised child and wait for it.
    Blocking: call it outside Trio. ``capture``: return its stdout and
    stderr (else they are this process's; ``quiet``: its stdout goes
    nowhere). In the main thread, a SIGTERM or SIGHUP stops the child and
    raises ``StoppedBySignal``; a SIGINT does the same and raises
    ``KeyboardInterrupt``."""
    argv = python_argv("trioserve.nurseries.supervision.entry", "run", module, *args)
    env = {**os.environ, **({SCRATCH_ENV: str(scratch)} if scratch is not None else {})}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "wb") as nowhere:
        stdout = out.fileno() if capture else nowhere.fileno() if quiet else None
        stderr = err.fileno() if capture else None
        try:
            code = trio.run(_run, argv, env, name, (stdout, stderr), timeout_s)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
        return Finished(code, _text(out), _text(err)) if capture else Finished(code)


def _text(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


async def _run(
    argv: list[str],
    env: dict[str, str],
    name: str,
    stdio: tuple[int | None, int | None],
    timeout_s: float | None,
) -> int | None:
    started: list[ChildProcess] = []

    async def supervise() -> None:  # returns once the child is reaped
        async with trio.open_nursery() as nursery:
            start = functools.partial(
                supervise_process,
                argv,
                name=name,
                env=env,
                grace_s=ONESHOT_GRACE_S,
                runs_to_end=True,
                stdout=stdio[0],
                stderr=stdio[1],
            )
            started.append(await nursery.start(start))

    with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")) as limit:
        if (signum := await until_stop_signal(supervise, interrupt=True)) is not None:  # stopped and reaped
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise StoppedBySignal(signum, f"stopped the {name} before it finished (nothing kept)")
    if limit.cancelled_caught or not started:
        return None  # stopped at its time limit (and reaped)
    return started[0].returncode


def stop_signals() -> tuple[signal.Signals, ...]:
    """What stops a command in order (its own graceful shutdown, or the end
    of what it started): a SIGTERM, and a SIGHUP (its terminal closed: left
    to its default, it kills the process at once, and its children find it gone),
    unless this process was started with SIGHUP ignored (``nohup``: then a
    hang-up must not stop it). SIGINT is apart: it raises KeyboardInterrupt."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return (signal.SIGTERM,)
    return (signal.SIGTERM, signal.SIGHUP)


def ignored_after_close(signals: tuple[signal.Signals, ...]) -> tuple[signal.Signals, ...]:
    """``signals``, each set to be ignored, for a Trio signal receiver to take
    over at once: when it closes it restores what it found, so a signal it
    has not taken then (one more during the stop, or as the program ends)
    is ignored, not fatal, until ``main`` restores the handlers (two signals
    close together must not kill a process half-way through its stop)."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    return signals


async def until_stop_signal(main: Callable[[], Awaitable[object]], *, interrupt: bool = False) -> signal.Signals | None:
    """Run ``main()``; a SIGTERM or SIGHUP (``stop_signals()``), and a SIGINT
    if ``interrupt`` (else it raises ``KeyboardInterrupt`` as usual), cancels
    it, so that what it started stops in order (a process killed by the
    signal would leave its children to find it gone). Returns the signal that
    stopped it, or None. Once one has come, they stay ignored
    (``ignored_after_close``) until ``main`` restores them; if none came,
    their handlers are put back at once. Outside the main thread, where no
    signal arrives, it only runs ``main()``."""
    if threading.current_thread() is not threading.main_thread():
        await main()
        return None
    taken = (signal.SIGINT, *stop_signals()) if interrupt else stop_signals()
    found = {signum: signal.getsignal(signum) for signum in taken}
    stopped_by: signal.Signals | None = None
    with trio.open_signal_receiver(*ignored_after_close(taken)) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                nonlocal stopped_by
                async for signum in signals:
                    stopped_by = stopped_by or signal.Signals(signum)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            await main()
            nursery.cancel_scope.cancel()
    if stopped_by is None:
        for signum, handler in found.items():
            if handler is not None:  # None: installed from C, which cannot be put back
                signal.signal(signum, handler)
    return stopped_by


async def oneshot_main(argv: list[str]) -> None:
    """The child: ``argv`` is ``MODULE ARG...``. Raises ``ChildFailed``
    (exit 1, one line) when the module's ``main`` exits with a non-zero code
    or raises (a full disk, a file it cannot read: the line names it)."""
    if not argv or not argv[0].startswith("trioserve."):
        raise ChildFailed(f"run: expected a trioserve module and its arguments, got {argv!r}")
    if (scratch := os.environ.pop(SCRATCH_ENV, None)) is not None:
        remove_if_parent_dies(scratch)
    module, args = argv[0], argv[1:]
    # Abandoned when the parent stops us: the process then exits without waiting for the program.
    code = await trio.to_thread.run_sync(functools.partial(_call_main, module, args), abandon_on_cancel=True)
    if code != 0:
        raise ChildFailed(f"{module} exited with code {code}")


def _call_main(module: str, args: list[str]) -> int:
    """``module.main(args)`` as ``python -m module`` would end it: its exit
    code. What it raises is ``ChildFailed`` (its last line, not a traceback:
    transformers nests the ``OSError`` of a full disk in tens of lines)."""
    try:
        importlib.import_module(module).main(args)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception as exc:
        raise ChildFailed(f"{module}: {describe(exc)}") from exc
    return 0
