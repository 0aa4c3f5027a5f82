"""The OpenAI-compatible API, ``/metrics`` and the engine's control calls: one HTTP request each.

``route_api`` (a plain function) decides which endpoint answers, or which error; ``HttpApi.handle`` reads the
body, runs the request through the engine, and writes the answer, whole or as server-sent events. Request
checks are the engine's (``openai_protocol.py`` maps its errors). While a
request runs, the connection is watched: a client that disconnects cancels
its request, which aborts every sample in the engine and frees their KV
blocks. A response (streamed or whole) whose client reads nothing for
``slow_consumer_timeout_s`` is ended the same way, and its connection closed.
A request still running when the shutdown grace is over is aborted and
answered like one the engine failed: a 503 ``shutdown`` (``engine_dead``
when the engine died for good), or in a stream an event holding that error
object, then ``[DONE]``.

``POST /v1/engine/pause`` (``?mode=wait|abort``), ``/v1/engine/resume``, ``/v1/engine/sleep``
(``?level=1|2&mode=...``) and ``/v1/engine/wake_up`` (each also ``?timeout_s=``) run the engine's control call
and answer ``{"health": ...}`` once it is done (docs/openai-api.md); ``ops_api.py`` the operators' calls.
"""

from __future__ import annotations

import importlib.metadata
import logging
import secrets
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import trio

from trioserve.api import Engine
from trioserve.errors import (
    ControlCallError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestError,
)
from trioserve.frontend.requests.streams import RequestStream
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.server import embeddings_api as embed
from trioserve.server import lora_api, ops_api
from trioserve.server import openai_protocol as oai
from trioserve.server import openai_responses as resp
from trioserve.server.chat_tools import plan_tools
from trioserve.server.config import ServerConfig
from trioserve.server.grace import Grace, Stopped, check_not_aborted
from trioserve.server.http import METRICS_PATH, BadRequest, RequestHead, encode_json
from trioserve.server.http_conn import HttpConnection
from trioserve.server.metrics import CONTENT_TYPE, ServerMetrics
from trioserve.server.openai_protocol import OpenAIError
from trioserve.server.sse import Choices, Event, EventFormat, PromptInfo, chat_format, completion_format
from trioserve.server.state import ServerState

log = logging.getLogger("trioserve.server")
Endpoint = Literal[
    "metrics", "models", "model", "completions", "chat", "embeddings", "control", "tokenize", "detokenize",
    "version", "ping", "lora", "ops",
]  # fmt: skip
_CONTROL_PREFIX = "/v1/engine/"
_MODEL_PREFIX = "/v1/models/"  # then a model's id (URL-encoded)
_CONTROL_CALLS = ("pause", "resume", "sleep", "wake_up")
_ENDPOINTS: dict[str, tuple[Endpoint, str]] = {
    METRICS_PATH: ("metrics", "GET"),
    "/v1/models": ("models", "GET"),
    "/v1/completions": ("completions", "POST"),
    "/v1/chat/completions": ("chat", "POST"),
    "/v1/embeddings": ("embeddings", "POST"),
    "/tokenize": ("tokenize", "POST"),
    "/detokenize": ("detokenize", "POST"),
    "/version": ("version", "GET"),
    "/ping": ("ping", "GET"),
    **{_CONTROL_PREFIX + call: ("control", "POST") for call in _CONTROL_CALLS},
    **{path: ("lora", "POST") for path in lora_api.LORA_PATHS},
    **{path: ("ops", "POST") for path in ops_api.OPS_PATHS},
}
RETRY_AFTER_S = 5  # for a 503 while the engine is busy, starting or restarting
_OPEN = ("metrics", "version", "ping")  # answered without the API key, as /health is
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def route_api(head: RequestHead, *, phase: str, api_key: str | None) -> Endpoint:
    """The endpoint for ``head``, or an ``OpenAIError``: 404 for an unknown
    path, 405 for a wrong method, 401 for a missing or wrong API key (not
    for ``/metrics``), 503 while the server is not ready."""
    path = head.path.rstrip("/") or "/"
    endpoint, method = _ENDPOINTS.get(path, (None, ""))
    if endpoint is None and path.startswith(_MODEL_PREFIX):
        endpoint, method = "model", "GET"
    if endpoint is None:
        raise OpenAIError(404, f"no such endpoint: {head.method} {head.path[:100]}", code="not_found")
    methods: tuple[str, ...] = (method, "HEAD") if method == "GET" else (method,)
    if endpoint == "ping":
        methods += ("POST",)  # (as vLLM's, for SageMaker)
    if head.method not in methods:
        raise OpenAIError(405, f"use {method} {head.path}", code="method_not_allowed")
    if endpoint in _OPEN:
        return endpoint
    if api_key is not None and not head.has_bearer_token(api_key):
        raise OpenAIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
    if phase != "ready":
        raise OpenAIError(503, f"the server is not serving ({phase})", type="server_error", code="unavailable")
    return endpoint


def _version() -> str:
    try:
        return importlib.metadata.version("trioserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def engine_error(exc: Exception, names: dict[str, str]) -> OpenAIError:
    """OpenAI's error for one the engine raised."""
    if isinstance(exc, InvalidRequestError):
        return OpenAIError.from_engine(exc, names)
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(503, str(exc), type="server_error", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestError):
        return OpenAIError(500, str(exc), type="server_error", code="request_failed")
    log.error("request failed", exc_info=exc)
    return OpenAIError(500, "internal server error (see the server's log)", type="server_error", code="internal")


def _error_headers(error: OpenAIError) -> list[tuple[str, str]]:
    if error.status == 401:
        return [("WWW-Authenticate", 'Bearer realm="trioserve"')]
    if error.status == 503:
        return [("Retry-After", str(RETRY_AFTER_S))]
    return []


class HttpApi:
    """Answers API requests for one server."""

    def __init__(self, state: ServerState, config: ServerConfig, metrics: ServerMetrics, model_name: str) -> None:
        self._state = state
        self._config = config
        self.metrics = metrics
        self.model_name = model_name
        self._started = resp.now()

    async def handle(self, conn: HttpConnection, head: RequestHead, client_id: str, body_deadline: float) -> None:
        """Answer one request on ``conn``. Raises ``BadRequest`` when its
        body cannot be read; leaves the response unsent (so the connection
        closes) when it has not arrived by ``body_deadline`` (then a 408). If the client disconnects, or this
        is cancelled, the request is aborted in the engine (its blocks freed) and the response may be cut
        short: the connection is to be closed."""
        origin = head.headers.get("origin")
        if origin is not None and self._origin_allowed(origin):
            conn.response_headers = self._cors_headers(origin)
        if head.method == "OPTIONS" and origin is not None and "access-control-request-method" in head.headers:
            await self._preflight(conn, head, origin)
            return
        try:
            endpoint = route_api(head, phase=self._state.phase, api_key=self._config.api_key)
        except OpenAIError as error:
            await conn.send_json(error.status, error.body(), _error_headers(error), head_only=head.method == "HEAD")
            return
        if endpoint == "version":
            await conn.send_json(200, {"version": _version()}, head_only=head.method == "HEAD")
        elif endpoint == "ping":
            phase = self._state.phase
            await conn.send_json(200 if phase == "ready" else 503, {"status": phase}, head_only=head.method == "HEAD")
        elif endpoint in ("tokenize", "detokenize"):
            body = await self._read_body(conn, body_deadline)
            try:
                answer = await self._tokens(endpoint, body)
            except OpenAIError as error:
                await conn.send_json(error.status, error.body(), _error_headers(error))
                return
            await conn.send_json(200, answer)
        elif endpoint == "metrics":
            payload = await self.metrics.render(self._state.engine)
            await conn.send_body(200, payload, CONTENT_TYPE, head_only=head.method == "HEAD")
        elif endpoint == "control":
            await self._control(conn, head)
        elif endpoint in ("lora", "ops"):
            body = await self._read_body(conn, body_deadline)
            calls = lora_api if endpoint == "lora" else ops_api  # adapters; profiling and scaling
            await calls.answer(conn, self._engine(), head.path.rstrip("/"), body)
        elif endpoint == "models":
            engine = self._engine()
            names = [self.model_name, *self._config.model_aliases]
            models = resp.models_list(names, engine, self._started)
            models.data += lora_api.adapter_models(engine, self.model_name, self._started)
            await conn.send_json(200, models, head_only=head.method == "HEAD")
        elif endpoint == "model":
            asked = unquote(head.path.rstrip("/").removeprefix(_MODEL_PREFIX))
            try:
                self._check_model(asked)  # the served name, or one of its aliases
            except OpenAIError as error:
                await conn.send_json(error.status, error.body(), head_only=head.method == "HEAD")
                return
            entry = resp.models_list([asked], self._engine(), self._started).data[0]
            await conn.send_json(200, entry, head_only=head.method == "HEAD")
        else:
            body = await self._read_body(conn, body_deadline)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.watch_disconnect, scope)
                    grace = Grace(self._state)
                    nursery.start_soon(grace.watch)
                    try:
                        await self._generate(conn, endpoint, body, client_id, grace)
                    except trio.TooSlowError:  # the response stays incomplete: the connection closes
                        log.debug(
                            "a client read nothing for %gs: its request was aborted",
                            self._config.slow_consumer_timeout_s,
                        )
                    nursery.cancel_scope.cancel()
            if scope.cancelled_caught:
                log.debug("a client went away: its request was aborted")

    async def _read_body(self, conn: HttpConnection, deadline: float) -> bytes:
        body: bytes | None = None
        with trio.move_on_at(deadline):
            body = await conn.read_body()
        if body is None:
            raise BadRequest("the request body did not arrive in time", status=408)
        return body

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self._config.allowed_origins
        return "*" in allowed or origin in allowed

    def _cors_headers(self, origin: str) -> list[tuple[str, str]]:
        """The CORS headers of a response to a request from ``origin`` (allowed)."""
        any_origin = "*" in self._config.allowed_origins and not self._config.allow_credentials
        headers = [("Access-Control-Allow-Origin", "*" if any_origin else origin)]
        if not any_origin:
            headers.append(("Vary", "Origin"))
        if self._config.allow_credentials:
            headers.append(("Access-Control-Allow-Credentials", "true"))
        return headers

    async def _preflight(self, conn: HttpConnection, head: RequestHead, origin: str) -> None:
        """A browser's CORS preflight (``OPTIONS`` with ``Origin`` and
        ``Access-Control-Request-Method``): answered without the API key
        (a browser never sends it with a preflight); 400 when the origin,
        method or headers are not allowed."""
        config = self._config
        method = head.headers["access-control-request-method"].strip()
        asked = [h.strip() for h in head.headers.get("access-control-request-headers", "").split(",") if h.strip()]
        problem = None
        if not self._origin_allowed(origin):
            problem = f"origin {origin[:100]!r} is not allowed (--allowed-origins)"
        elif "*" not in config.allowed_methods and method not in config.allowed_methods:
            problem = f"method {method[:20]!r} is not allowed (--allowed-methods)"
        elif "*" not in config.allowed_headers and (
            missing := [h for h in asked if h.lower() not in {a.lower() for a in config.allowed_headers}]
        ):
            problem = f"header {missing[0][:60]!r} is not allowed (--allowed-headers)"
        if problem is not None:
            error = OpenAIError(400, f"CORS preflight refused: {problem}", code="cors_refused")
            await conn.send_json(error.status, error.body())
            return
        methods = (
            "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
            if "*" in config.allowed_methods
            else ", ".join(config.allowed_methods)
        )
        headers = [
            ("Access-Control-Allow-Methods", methods),
            ("Access-Control-Max-Age", str(CORS_MAX_AGE_S)),
        ]
        allowed_headers = ", ".join(asked) if "*" in config.allowed_headers else ", ".join(config.allowed_headers)
        if allowed_headers:
            headers.append(("Access-Control-Allow-Headers", allowed_headers))
        await conn.send_body(200, b"OK", "text/plain; charset=utf-8", headers)

    async def _tokens(self, endpoint: Endpoint, body: bytes) -> dict[str, object]:
        """``/tokenize`` (a ``prompt`` or chat ``messages``) and ``/detokenize`` (``tokens``), as vLLM's."""
        engine = self._engine()
        if endpoint == "detokenize":
            request: Any = oai.decode_body(body, oai.DetokenizeRequest, strict=self._config.strict_fields)
            if request.model is not None:
                self._check_model(request.model)
            vocab = engine.info.vocab_size
            if bad := next((t for t in request.tokens if not 0 <= t < vocab), None):
                raise oai.invalid("tokens", f"token ids must be in [0, {vocab}) (got {bad})")
            return {"prompt": engine.tokenizer.decode(request.tokens, skip_special_tokens=False)}
        request = oai.decode_body(body, oai.TokenizeRequest, strict=self._config.strict_fields)
        if request.model is not None:
            self._check_model(request.model)
        try:
            if request.messages is not None:
                chat = oai.ChatCompletionRequest(model="", messages=request.messages)
                tools = plan_tools(request.tools, "none", parser=None)
                text = await engine.render_chat(
                    oai.chat_messages(chat),
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    variables=request.chat_template_kwargs,
                    special_tokens_in_content=self._config.special_tokens_in_content,
                    tools=None if tools is None else tools.template_tools,
                )
                tokens = await engine.tokenize(text)
            elif request.prompt is not None:
                tokens = engine.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            else:
                raise oai.invalid("prompt", "give a 'prompt' or 'messages'", code="missing_field")
        except InvalidRequestError as exc:
            raise OpenAIError.from_engine(exc, {}) from None
        return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens, "token_strs": None}

    async def _control(self, conn: HttpConnection, head: RequestHead) -> None:
        """Run the control call the path names; 200 with the engine's health
        after it, 400 for a bad query value, 500 when the call failed, 503
        ``engine_restarting`` when it failed only for engine cores not up
        (several API servers), 503 ``engine_dead`` when none is. If
        cancelled (the client went away), the call may still take effect."""
        engine = self._engine()
        call = head.path.rstrip("/").removeprefix(_CONTROL_PREFIX)
        query = {k: v[-1] for k, v in parse_qs(urlsplit(head.target).query).items()}
        try:
            timeout_s = float(query["timeout_s"]) if "timeout_s" in query else None  # None: the engine's default
            mode: Any = query.get("mode", "wait")
            if call == "pause":
                await engine.pause(mode=mode, timeout_s=timeout_s)
            elif call == "resume":
                await engine.resume(timeout_s=timeout_s)
            elif call == "sleep":
                level: Any = int(query.get("level", "1"))
                await engine.sleep(level, mode=mode, timeout_s=timeout_s)
            else:
                await engine.wake_up(timeout_s=timeout_s)
        except ValueError as exc:  # InvalidRequestError, or a number that does not parse
            error = OpenAIError(400, f"{call}: {exc}", code="invalid_value")
        except ControlCallError as exc:  # (a 503, with Retry-After, while it failed only for restarting engines)
            status, code = (503, "engine_restarting") if exc.restarting else (500, "control_failed")
            error = OpenAIError(status, str(exc), type="server_error", code=code)
        except EngineDeadError as exc:
            error = engine_error(exc, {})
        else:
            await conn.send_json(200, resp.EngineHealth(health=engine.health))
            return
        await conn.send_json(error.status, error.body(), _error_headers(error))

    def _engine(self) -> Engine:
        engine = self._state.engine
        assert engine is not None  # route_api lets requests through only when ready
        return engine

    async def _generate(
        self, conn: HttpConnection, endpoint: Endpoint, body: bytes, client_id: str, grace: Grace
    ) -> None:
        """Run a completion or chat request and answer it (an error object
        if it fails before its first byte, or is still running when the
        shutdown grace is over). If cancelled, it is aborted."""
        names: dict[str, str] = embed.NAMES if endpoint == "embeddings" else {}
        try:
            if endpoint == "embeddings":
                request = oai.decode_body(body, embed.EmbeddingRequest, strict=self._config.strict_fields)
                self._check_model(request.model)
                await conn.send_json(200, await embed.embeddings(self._engine(), request, self.model_name, client_id))
                return
            stream, fmt, plan, prompt = await self._start(endpoint, body, client_id)
            names = plan.names
            conn.log_fields["request_id"] = stream.request_id
            async with stream:
                fmt.prompt = _prompt_info(prompt, stream.prompt_token_ids, fmt.tokenizer)
                if plan.stream:
                    await self._send_events(conn, stream, fmt, plan.include_usage, grace)
                else:
                    await self._send_whole(conn, stream, fmt, grace)
        except OpenAIError as exc:
            await conn.send_json(exc.status, exc.body(), _error_headers(exc))
        except (InvalidRequestError, RequestError, EngineDeadError) as exc:
            mapped = engine_error(exc, names)
            await conn.send_json(mapped.status, mapped.body(), _error_headers(mapped))
        except Exception as exc:  # a bug: a 500 (logged) if the response has not begun, else the connection ends
            if conn.response_started:
                raise
            mapped = engine_error(exc, names)
            await conn.send_json(mapped.status, mapped.body(), _error_headers(mapped))

    async def _start(
        self, endpoint: Endpoint, body: bytes, client_id: str
    ) -> tuple[RequestStream, EventFormat, oai.Plan, Any]:
        """Decode and check the request; its stream (not yet entered), and its prompt."""
        engine = self._engine()
        names = {"prompt": "messages"} if endpoint == "chat" else {}
        try:
            if endpoint == "chat":
                chat = oai.decode_body(body, oai.ChatCompletionRequest, strict=self._config.strict_fields)
                lora = self._check_model(chat.model)
                auto_parser = self._config.tool_call_parser if self._config.enable_auto_tool_choice else None
                plan = oai.plan_chat(chat, engine.info.max_model_len, tool_call_parser=auto_parser)
                plan = lora_api.with_adapter(plan, lora)
                prompt: Any = await engine.render_chat(
                    oai.chat_messages(chat),
                    add_generation_prompt=chat.add_generation_prompt,
                    continue_final_message=chat.continue_final_message,
                    special_tokens_in_content=self._config.special_tokens_in_content,
                    tools=None if plan.tools is None else plan.tools.template_tools,
                    documents=chat.documents,
                    variables=chat.chat_template_kwargs,
                )
                fmt: EventFormat = chat_format(
                    lora or self.model_name, engine.tokenizer, tools=plan.tools, **_format_options(plan)
                )
                prompts = [prompt]
            else:
                completion = oai.decode_body(body, oai.CompletionRequest, strict=self._config.strict_fields)
                lora = self._check_model(completion.model)
                plan = lora_api.with_adapter(oai.plan_completion(completion), lora)
                prompts = oai.completion_prompts(completion)
                prompt = prompts[0]
                fmt = completion_format(
                    lora or self.model_name, engine.tokenizer, echo=plan.echo, **_format_options(plan)
                )
            names = plan.names
            if plan.params.structured is not None:
                await engine.check_structured(plan.params.structured)
            if len(prompts) > 1:  # a batch: its prompts' samples are the choices, in order
                return engine.stream_prompts(prompts, plan.params, plan.n, client_id=client_id), fmt, plan, prompt
            return engine.stream_n(prompt, plan.params, plan.n, client_id=client_id), fmt, plan, prompt
        except InvalidRequestError as exc:
            raise OpenAIError.from_engine(exc, names) from None

    def _check_model(self, model: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the served model), or a 404."""
        return lora_api.adapter_for(model, self.model_name, self._config.model_aliases, self._state.engine)

    async def _send_whole(self, conn: HttpConnection, stream: RequestStream, fmt: EventFormat, grace: Grace) -> None:
        """Collect every sample to its end, then send one JSON response."""
        choices = Choices(stream.n)
        try:
            while (out := await grace.next_output(stream)) is not None:
                check_not_aborted(out)
                choices.add(out)
        except Stopped as stop:
            raise stop.error() from None
        conn.log_fields.update(prompt_tokens=stream.num_prompt_tokens, generated_tokens=choices.completion_tokens)
        await conn.send_json(200, fmt.response(choices, stream.num_prompt_tokens))

    async def _send_events(
        self, conn: HttpConnection, stream: RequestStream, fmt: EventFormat, include_usage: bool, grace: Grace
    ) -> None:
        """Send each delta as a server-sent event as it comes, then the usage
        (when asked for) and ``[DONE]``. An engine error after the first
        event, or the end of the shutdown grace, is sent as an event holding
        the error object."""
        await conn.start_stream(200, "text/event-stream")
        choices = Choices(stream.n)
        for event in fmt.opening(stream.n, include_usage):
            await self._send_event(conn, event)
        try:
            while (out := await grace.next_output(stream)) is not None:
                check_not_aborted(out)
                choices.add(out)
                if out.text or out.finished or out.logprobs:  # else: bytes of a character still to come
                    await self._send_event(conn, fmt.chunk(out, choices, include_usage))
        except (RequestError, EngineDeadError) as exc:
            await self._send_event(conn, engine_error(exc, {}).body())
        except Stopped as stop:
            await self._send_event(conn, stop.error().body())
        else:
            conn.log_fields.update(prompt_tokens=stream.num_prompt_tokens, generated_tokens=choices.completion_tokens)
            if include_usage:
                await self._send_event(conn, fmt.usage_chunk(choices, stream.num_prompt_tokens))
        await self._send_line(conn, b"data: [DONE]\n\n")
        await conn.end_stream()

    async def _send_event(self, conn: HttpConnection, event: Event | resp.ErrorBody) -> None:
        await self._send_line(conn, b"data: " + encode_json(event) + b"\n\n")

    async def _send_line(self, conn: HttpConnection, data: bytes) -> None:
        """Send, or give up on a client that reads nothing for
        ``slow_consumer_timeout_s`` (the request is then aborted)."""
        with trio.fail_after(self._config.slow_consumer_timeout_s):
            await conn.send_data(data)


def _format_options(plan: oai.Plan) -> dict[str, bool]:
    resumes, logprobs = plan.include_resumes, plan.prompt_logprobs
    usage = plan.include_usage and plan.continuous_usage
    return {"continuous_usage": usage, "prompt_logprobs": logprobs, "include_resumes": resumes}


def _prompt_info(prompt: object, token_ids: list[int], tokenizer: Tokenizer) -> PromptInfo:
    """The prompt as a response shows it: a text as given; token ids (or a
    chat's rendered messages) decoded, special tokens included."""
    if type(prompt) is str:
        return PromptInfo(prompt, token_ids)
    return PromptInfo(tokenizer.decode(token_ids, skip_special_tokens=False), token_ids, special_tokens_shown=True)


def new_client_id() -> str:
    """The engine admits waiting requests by client in turn: one id per connection."""
    return f"http-{secrets.token_hex(4)}"
