"""Entry point of an API-server process: ``python -m trioserve.server``
(started by ``serve --api-server-count M``; see ``api_servers.py``)."""

from __future__ import annotations

import logging

from trioserve.nurseries.process import run_child_main
from trioserve.server.api_servers import api_server_main
from trioserve.stdio import child_log_level, ensure_standard_fds

ensure_standard_fds()  # before anything opens a descriptor (imports open none that stay)
logging.basicConfig(
    level=child_log_level(),
    format="%(levelname)s api-server[%(process)d] %(name)s: %(message)s",
)
run_child_main(api_server_main, name="trioserve-api-server")
