"""LoRA adapters over HTTP, as vLLM serves them: a request whose ``model``
is an adapter's name runs with that adapter; ``GET /v1/models`` lists the
adapters after the base model, each with the base as ``parent``; ``POST
/v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``POST
/v1/unload_lora_adapter`` (``{"lora_name"}``) add and remove them while
serving, behind the API key, on a server started with ``--enable-lora``
(a 404 otherwise)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from trioserve.api import Engine
from trioserve.errors import ControlCallError, InvalidRequestError
from trioserve.server import openai_protocol as oai
from trioserve.server.http_conn import HttpConnection
from trioserve.server.openai_protocol import OpenAIError, Plan
from trioserve.server.openai_responses import Model

LORA_PATHS = {"/v1/load_lora_adapter": "load", "/v1/unload_lora_adapter": "unload"}


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; unused (an adapter is named)


def adapter_for(model: str, served: str, aliases: Sequence[str], engine: Engine | None) -> str | None:
    """The adapter a request's ``model`` names (None: the base model), or a
    404 naming what is served."""
    if model == served or model in aliases:
        return None
    adapters = engine.lora_names if engine is not None else frozenset()
    if model in adapters:
        return model
    also = f" and the adapters {', '.join(repr(a) for a in sorted(adapters))}" if adapters else ""
    raise OpenAIError(
        404,
        f"model: {model[:100]!r} is not served here; this server serves {served!r}{also}",
        param="model",
        code="model_not_found",
    )


def with_adapter(plan: Plan, lora: str | None) -> Plan:
    """``plan`` with its requests run with adapter ``lora`` (None: as it is)."""
    if lora is None:
        return plan
    return msgspec.structs.replace(plan, params=msgspec.structs.replace(plan.params, lora=lora))


def adapter_models(engine: Engine, base: str, created: int) -> list[Model]:
    """``/v1/models``' entries of the adapters, after the base model's."""
    max_model_len = engine.info.max_model_len
    return [
        Model(id=name, created=created, max_model_len=max_model_len, parent=base) for name in sorted(engine.lora_names)
    ]


async def answer(conn: HttpConnection, engine: Engine, path: str, body: bytes) -> None:
    """Answer a load or unload request on ``conn``."""
    try:
        status, reply = await load_or_unload(engine, path, body, strict=False)
    except OpenAIError as error:
        status, reply = error.status, error.body()
    await conn.send_json(status, reply)


async def load_or_unload(engine: Engine, path: str, body: bytes, *, strict: bool) -> tuple[int, object]:
    """Answer ``POST /v1/load_lora_adapter`` or ``/v1/unload_lora_adapter``:
    the status and the body. A bad adapter (or a name already served) is a
    400 naming the file and the problem; an unknown name to unload, a 404."""
    if not engine.config.enable_lora:
        raise OpenAIError(404, "LoRA adapters are off on this server: start it with --enable-lora", code="not_found")
    try:
        if LORA_PATHS[path] == "load":
            load = oai.decode_body(body, LoadLoraRequest, strict=strict)
            info = await engine.add_lora(load.lora_name, load.lora_path)
            return 200, {"object": "lora_adapter", "name": info.name, "path": info.path, "rank": info.rank}
        unload = oai.decode_body(body, UnloadLoraRequest, strict=strict)
        await engine.remove_lora(unload.lora_name)
        return 200, {"object": "lora_adapter", "name": unload.lora_name, "deleted": True}
    except InvalidRequestError as exc:
        raise OpenAIError.from_engine(exc, {}) from None
    except ControlCallError as exc:
        if exc.restarting:
            raise OpenAIError(503, str(exc), type="server_error", code="unavailable") from None
        status = 404 if "no adapter named" in str(exc) else 400
        raise OpenAIError(status, str(exc), param="lora_name", code="invalid_adapter") from None
