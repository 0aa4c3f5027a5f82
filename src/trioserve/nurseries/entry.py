"""Entry point of every child process: ``python -m trioserve.nurseries.entry ROLE``.

ROLE is ``engine-core``, ``worker`` or ``build`` (``build MODULE ARG...``: a
model builder, see ``builder.py``). Kept apart from the modules it runs so
that ``-m`` never executes a module the package has already imported.
"""

from __future__ import annotations

import functools
import logging
import os
import sys


def main(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("TRIOSERVE_LOG_LEVEL", "WARNING"),
        format=f"%(levelname)s {role}[%(process)d] %(name)s: %(message)s",
    )
    from trioserve.nurseries.process import run_child_main

    if role == "engine-core":
        from trioserve.nurseries.engine_core import engine_core_main

        run_child_main(engine_core_main, name="trioserve-engine-core")
    elif role == "worker":
        from trioserve.nurseries.worker import worker_main

        run_child_main(worker_main, name="trioserve-worker")
    elif role == "build":
        from trioserve.nurseries.builder import builder_main

        run_child_main(functools.partial(builder_main, sys.argv[2:]), name="trioserve-build")
    else:
        sys.exit(f"trioserve.nurseries.entry: unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
