"""Entry point of every child process: ``python -m trioserve.nurseries.supervision.entry ROLE``.

ROLE is ``engine-core``, ``worker``, ``ray-head`` (a local Ray cluster,
``nurseries/ray/head.py``) or ``run`` (``run MODULE ARG...``: a one-shot
program, a model builder or a benchmark baseline, see ``oneshot.py``).
Kept apart from the modules it runs so that ``-m`` never executes a module
the package has already imported.
"""

from __future__ import annotations

import functools
import signal
import sys


def main(role: str) -> None:
    # First of all, before the slow imports: Ctrl-C reaches the whole process group, and it is
    # the parent's to handle (run_child_main keeps SIGINT ignored; a Ctrl-C while a child still
    # imports would print its KeyboardInterrupt traceback). So does a terminal's SIGHUP: children
    # in their parent's group would die of it at once, before their parent stops them in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from trioserve.stdio import child_log_format, child_log_level, configure_logging, ensure_standard_fds

    ensure_standard_fds()  # before anything opens a descriptor that stays open
    configure_logging(child_log_level(), child_log_format(), role)
    from trioserve.nurseries.supervision.process import run_child_main

    if role == "engine-core":
        from trioserve.nurseries.engine_core.main import engine_core_main

        run_child_main(engine_core_main, name="trioserve-engine-core")
    elif role == "worker":
        from trioserve.nurseries.worker.main import worker_main

        run_child_main(worker_main, name="trioserve-worker")
    elif role == "ray-head":
        from trioserve.nurseries.ray.head import ray_head_main

        run_child_main(ray_head_main, name="trioserve-ray-head")
    elif role == "run":
        from trioserve.nurseries.supervision.oneshot import oneshot_main

        run_child_main(functools.partial(oneshot_main, sys.argv[2:]), name="trioserve-oneshot")
    else:
        sys.exit(f"trioserve.nurseries.supervision.entry: unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
