"""Operators' calls over HTTP, at vLLM's paths and with its bodies, behind the API key:

- ``POST /scale_elastic_ep`` ``{"new_data_parallel_size": N, "drain_timeout": S}`` (S seconds, default 120)
  grows or shrinks the engine cores (``Engine.scale``) and answers once done: 200 ``{"message": ...}``; 400
  naming the field for a bad body or a size that cannot be (below 1, above 64, engines on other hosts, several
  API servers); 409 while another scale runs; 500 when new engines could not start (nothing changed then).
- ``POST /is_scaling_elastic_ep``: ``{"is_scaling_elastic_ep": true|false}``.
- ``POST /start_profile`` and ``POST /stop_profile`` (on a server started with ``--profiler-dir``; a 404
  otherwise). A stop answers the traces written.
"""

from __future__ import annotations

import msgspec

from trioserve.api import Engine
from trioserve.errors import ControlCallError, EngineDeadError, InvalidRequestError
from trioserve.frontend.engine_ops import DEFAULT_DRAIN_TIMEOUT_S
from trioserve.server import openai_protocol as oai
from trioserve.server.http_conn import HttpConnection
from trioserve.server.openai_protocol import OpenAIError

OPS_PATHS = ("/start_profile", "/stop_profile", "/scale_elastic_ep", "/is_scaling_elastic_ep")


class ScaleRequest(msgspec.Struct, forbid_unknown_fields=False):
    new_data_parallel_size: int
    drain_timeout: int = int(DEFAULT_DRAIN_TIMEOUT_S)  # seconds (vLLM's: a positive integer)


async def answer(conn: HttpConnection, engine: Engine, path: str, body: bytes) -> None:
    """Answer one operator's call on ``conn``."""
    try:
        status, reply = await run(engine, path, body)
    except OpenAIError as error:
        status, reply = error.status, error.body()
    await conn.send_json(status, reply)


async def run(engine: Engine, path: str, body: bytes) -> tuple[int, object]:
    """The status and body for ``path`` (see the module docstring)."""
    if path == "/is_scaling_elastic_ep":
        return 200, {"is_scaling_elastic_ep": engine.is_scaling}
    if path == "/scale_elastic_ep":
        return await _scale(engine, body)
    return await _profile(engine, path)


async def _scale(engine: Engine, body: bytes) -> tuple[int, object]:
    request = oai.decode_body(body, ScaleRequest)
    if request.drain_timeout <= 0:
        raise oai.invalid("drain_timeout", "must be a positive number of seconds")
    try:
        await engine.scale(request.new_data_parallel_size, drain_timeout_s=request.drain_timeout)
    except InvalidRequestError as exc:
        field = "new_data_parallel_size" if exc.field == "data_parallel_size" else exc.field
        raise OpenAIError(
            400, f"{field}{str(exc).removeprefix(exc.field)}", param=field, code="invalid_value"
        ) from None
    except ControlCallError as exc:
        status, code = (409, "scale_under_way") if "under way" in str(exc) else (500, "scale_failed")
        raise OpenAIError(status, str(exc), type="server_error", code=code) from None
    return 200, {"message": f"Scaled to {request.new_data_parallel_size} data parallel engines"}


async def _profile(engine: Engine, path: str) -> tuple[int, object]:
    """200 once done; 404 when profiling is off; 409 for a start while
    recording or a stop while not; 503 while the engine cores that would
    record are down."""
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
