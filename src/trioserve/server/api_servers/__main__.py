"""Entry point of an API-server process: ``python -m trioserve.server.api_servers``
(started by ``serve --api-server-count M``; see ``api_servers.py``)."""

from __future__ import annotations

import signal

# First, before the slow imports: Ctrl-C, and a terminal's SIGHUP, are the supervising process's to
# handle (as in nurseries/supervision/entry.py).
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)

from trioserve.nurseries.supervision.process import run_child_main  # noqa: E402
from trioserve.server.api_servers.supervisor import api_server_main  # noqa: E402
from trioserve.stdio import child_log_format, child_log_level, configure_logging, ensure_standard_fds  # noqa: E402

ensure_standard_fds()  # before anything opens a descriptor (imports open none that stay)
configure_logging(child_log_level(), child_log_format(), "api-server")
run_child_main(api_server_main, name="trioserve-api-server")
