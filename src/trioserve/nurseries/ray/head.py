"""A local Ray cluster as a supervised child: ``python -m trioserve.nurseries.supervision.entry ray-head``.

When ``--data-parallel-backend ray`` is given no cluster address, the
front-end starts one on this host: this process, a child like any other
(``run_child_main``), leading a process group of its own, runs ``ray start
--head --block`` in that group with the options the front-end wrote into
``RAY_HEAD_ARGS_ENV``. Every process Ray starts for the node (its GCS, its
raylet and agents, its workers, which die with the raylet) lives in that
group, so:

- a stop ends ``ray start`` with SIGTERM at once, which shuts the node
  down in about half a second; the front-end then kills what is left of
  the group when it reaps this process;
- when the front-end is gone (``kill -9``), this process kills the whole
  group, itself included (``run_child_main``): no Ray process outlives its
  front-end, which ``ray.init()``'s own local cluster does not promise (its
  agents outlive a killed driver).

Ray's own placement of actors is untouched: this only owns the node's
processes.
"""

from __future__ import annotations

import os
import signal
import sys

import trio

from trioserve.nurseries.supervision.child_main import HARD_EXIT_ENV, ChildFailed, remove_if_parent_dies, signal_child
from trioserve.nurseries.supervision.process import ChildProcess, ProcessExited, supervise_process

RAY_HEAD_ARGS_ENV = "TRIOSERVE_RAY_HEAD_ARGS"  # ``ray start`` options, one per line
# The front-end's private directory for the cluster (Ray's temporary directory is in it): ``ray start``
# writes there (its last lines are told if it fails), and it is removed here if the front-end dies.
RAY_HEAD_DIR_ENV = "TRIOSERVE_RAY_HEAD_DIR"
RAY_GRACE_S = 2.5  # after a stop, SIGTERM is sent at once; SIGKILL (``ray start`` alone) this much later
RAY_HARD_EXIT_S = 3.0  # this process's hard exit after a stop (its parent sets it): Ray's shutdown fits


def ray_start_argv(options: list[str]) -> list[str]:
    """``ray start --head --block`` with ``options``, by this interpreter."""
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", *options]


async def ray_head_main() -> None:
    """Run ``ray start --head --block`` until stopped: then SIGTERM at once,
    on which it shuts its node down itself. Its exit, unasked, raises
    ``ProcessExited``: the cluster is gone, and so is every engine on it."""
    options = [part for part in os.environ.get(RAY_HEAD_ARGS_ENV, "").splitlines() if part]
    directory = os.environ.get(RAY_HEAD_DIR_ENV)
    log_path = os.devnull if directory is None else os.path.join(directory, "ray-start.log")
    if directory is not None:
        remove_if_parent_dies(directory)
    output = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        try:
            async with trio.open_nursery() as nursery:
                child: ChildProcess = await nursery.start(
                    lambda task_status: supervise_process(
                        ray_start_argv(options),
                        name="ray-start",
                        grace_s=RAY_GRACE_S,
                        env={k: v for k, v in os.environ.items() if k not in (HARD_EXIT_ENV, RAY_HEAD_DIR_ENV)},
                        stdout=output,
                        stderr=output,
                        task_status=task_status,
                    )
                )
                try:
                    await trio.sleep_forever()
                finally:
                    if child.returncode is None:
                        child.expect_exit()
                        signal_child(child.pid, signal.SIGTERM, group=False)
        except* ProcessExited:
            raise ChildFailed(f"ray start failed; its last lines: {_tail(log_path)}") from None
    finally:
        os.close(output)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return "(none)"
