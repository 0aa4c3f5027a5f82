"""Operators' calls over HTTP, at vLLM's paths, behind the API key:
``POST /start_profile`` and ``POST /stop_profile`` (on a server started with
``--profiler-dir``; a 404 otherwise). A stop answers the traces written."""

from __future__ import annotations

from trioserve.api import Engine
from trioserve.errors import ControlCallError, EngineDeadError
from trioserve.server.http_conn import HttpConnection
from trioserve.server.openai_protocol import OpenAIError

OPS_PATHS = ("/start_profile", "/stop_profile")


async def answer(conn: HttpConnection, engine: Engine, path: str, body: bytes) -> None:
    """Answer one operator's call on ``conn``."""
    try:
        status, reply = await run(engine, path, body)
    except OpenAIError as error:
        status, reply = error.status, error.body()
    await conn.send_json(status, reply)


async def run(engine: Engine, path: str, body: bytes) -> tuple[int, object]:
    """The status and body for ``path``: 200 once done; 404 when profiling is
    off; 409 for a start while recording or a stop while not; 503 while the
    engine cores that would record are down."""
    if engine.config.profiler_dir is None:
        raise OpenAIError(404, "profiling is off on this server: start it with --profiler-dir DIR", code="not_found")
    try:
        if path == "/start_profile":
            await engine.start_profile()
            return 200, {"profiling": True}
        traces = await engine.stop_profile()
        return 200, {"profiling": False, "traces": traces}
    except ControlCallError as exc:
        if exc.restarting:
            raise OpenAIError(503, str(exc), type="server_error", code="unavailable") from None
        raise OpenAIError(409, str(exc), code="profile_state") from None
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc), type="server_error", code="engine_dead") from None
