"""The public face for Trio programs: ``open_engine``, ``Engine``, ``RequestStream``.

This is the one place where exception groups from inside the project are
collapsed into plain exceptions (``EngineStartupError``, ``EngineDeadError``,
``RequestError``, ``ValueError``, or the caller's own exception).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, EngineStartupError, InvalidRequestError, collapse
from trioserve.frontend.client import EngineCoreClient
from trioserve.frontend.model_dir import load_model_dir
from trioserve.frontend.outputs import RequestOutput
from trioserve.frontend.prompt import Prompt, PromptChecker
from trioserve.frontend.request_state import RequestState
from trioserve.frontend.supervisor import EngineSupervisor, Health
from trioserve.frontend.tokenizer import Tokenizer
from trioserve.messages import EngineInfo, EngineStats, SamplingParams


@contextlib.asynccontextmanager
async def open_engine(
    model: str | None = None, *, config: EngineConfig | None = None, **options: Any
) -> AsyncIterator[Engine]:
    """Start an engine (an engine-core process and its workers) for the
    duration of the block.

    Give either ``model`` (a local Hugging Face model directory) and any other
    ``EngineConfig`` fields as keywords, or a whole ``config``. Start-up
    failures raise ``EngineStartupError``. When the block exits, normally, by
    an exception or by cancellation, every process is stopped and reaped
    before this returns.

    If the engine core (or a worker) dies while the block runs, the requests
    in flight raise ``EngineDeadError`` and the engine is restarted (see
    ``EngineConfig.max_restarts``); new requests wait for it. Once out of
    restarts, every request raises ``EngineDeadError`` and ``wait_failed()``
    returns; the block itself is never interrupted.
    """
    if config is None:
        if model is None:
            raise ValueError("model: give a model directory (or config=EngineConfig(...))")
        config = EngineConfig(model=model, **options)
    elif model is not None or options:
        raise ValueError("config: give either config=... or model and options, not both")
    tokenizer = await trio.to_thread.run_sync(_load_tokenizer, config)
    try:
        async with trio.open_nursery() as nursery:
            supervisor = EngineSupervisor(config)
            await nursery.start(supervisor.run)
            try:
                yield Engine(supervisor, tokenizer)
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def _load_tokenizer(config: EngineConfig) -> Tokenizer:
    """The model directory's tokenizer, once the directory is checked; a
    missing or broken one is a start-up error naming the path."""
    try:
        return load_model_dir(config.model, needs_weights=config.runner == "hf")
    except (OSError, ValueError) as exc:  # each names the directory or the file
        raise EngineStartupError(str(exc), stage="tokenizer") from None


class Engine:
    """A running engine. Get one from ``open_engine``."""

    def __init__(self, supervisor: EngineSupervisor, tokenizer: Tokenizer) -> None:
        self._supervisor = supervisor
        self.tokenizer = tokenizer
        self._prompts = PromptChecker(tokenizer, self.info)
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(3)

    @property
    def config(self) -> EngineConfig:
        return self._supervisor.config

    @property
    def info(self) -> EngineInfo:
        """What the engine core reported when it became ready (after a
        restart, the new one's: its process ids change)."""
        assert self._supervisor.info is not None  # set before the Engine exists
        return self._supervisor.info

    @property
    def health(self) -> Health:
        """``starting``, ``ready``, ``stalled`` (ready, but a hang is suspected:
        see ``EngineConfig.heartbeat_timeout_s``), ``restarting`` (the engine
        core died, or was declared hung and killed, and is being restarted),
        ``failed`` (out of restarts: for good) or ``stopped``."""
        return self._supervisor.health

    @property
    def num_restarts(self) -> int:
        """How many times the engine core has been restarted."""
        return self._supervisor.num_restarts

    async def wait_failed(self) -> EngineDeadError:
        """Wait until the engine has failed for good (it died more often than
        its restart budget allows); returns the error every request now raises."""
        return await self._supervisor.wait_failed()

    async def wait_ready(self) -> None:
        """Wait until the engine is ready (at once, unless it is restarting).
        Raises ``EngineDeadError`` if it failed or stopped instead."""
        await self._supervisor.wait_health("ready", "failed", "stopped")
        if self.health != "ready":
            await self._supervisor.ready_client()  # raises the reason

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, client_id: str = "") -> RequestStream:
        """A request whose outputs arrive as they are produced.

        Use as ``async with engine.stream(prompt, params) as stream: async for
        out in stream: ...``. ``prompt`` is text or a list of token ids.
        Invalid input raises ``InvalidRequestError`` (a ``ValueError``)
        naming the field, before anything is sent: here, or, for a text long
        enough to be tokenized in a thread (``frontend/prompt.py``), when the
        block is entered. A prompt that does not fit the context raises
        ``PromptTooLongError`` (one of those). Waiting requests of different
        ``client_id``s are admitted in turn. Leaving the block before the
        request finished, or being cancelled, aborts it in the engine and
        frees its KV blocks.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be a SamplingParams (got {type(params).__name__})")
        if not isinstance(client_id, str):
            raise InvalidRequestError("client_id", f"must be a string (got {type(client_id).__name__})")
        token_ids = None if self._prompts.needs_thread(prompt) else self._prompts.check(prompt)
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        return RequestStream(self, request_id, prompt, token_ids, params, client_id)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Run a request to the end: one output holding all its text and tokens.

        If cancelled, the request is aborted in the engine.
        """
        result: RequestOutput | None = None
        async with self.stream(prompt, params) as stream:
            async for output in stream:
                if result is None:
                    result = output
                else:
                    result.merge(output)
        assert result is not None  # a stream ends only after a finished output
        return result

    async def stats(self) -> EngineStats:
        """The engine core's counters (running and waiting requests, free KV
        blocks). While the engine restarts, waits for it like a request."""
        client = await self._supervisor.ready_client()
        return await client.stats()

    def num_requests_in_flight(self) -> int:
        """Requests the front-end holds state for (submitted and not yet over)."""
        client = self._supervisor.client
        return 0 if client is None else len(client.requests)

    async def _submit(self, state: RequestState) -> EngineCoreClient:
        """Submit a checked request (waiting for a restarting engine at most
        ``restart_wait_s``); the client it went to. If cancelled, it was not
        submitted."""
        client = await self._supervisor.ready_client()
        await client.submit(state)
        return client


class RequestStream:
    """One streaming request; an async context manager and an async iterator of
    ``RequestOutput`` deltas. Iteration ends after the output whose
    ``finish_reason`` is set."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt: Prompt,
        token_ids: list[int] | None,
        params: SamplingParams,
        client_id: str,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._prompt = prompt
        self._token_ids = token_ids  # None until a long text prompt is tokenized
        self._params = params
        self._client_id = client_id
        self._client: EngineCoreClient | None = None
        self._state: RequestState | None = None
        self._done = False

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens (known once the block is entered)."""
        return 0 if self._token_ids is None else len(self._token_ids)

    async def __aenter__(self) -> RequestStream:
        """Check the prompt, if that is still to do, and submit the request.
        If cancelled, it was not submitted."""
        if self._token_ids is None:
            self._token_ids = await self._engine._prompts.check_async(self._prompt)
        self._state = RequestState(
            self.request_id, self._token_ids, self._params, self._engine.tokenizer, client_id=self._client_id
        )
        self._client = await self._engine._submit(self._state)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done and self._client is not None:
            self._client.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta. If cancelled, nothing is lost: it stays for the next call."""
        if self._done:
            raise StopAsyncIteration
        if self._state is None:
            raise RuntimeError("iterate a RequestStream inside its async with block")
        try:
            output = await self._state.collector.get()
        except Exception:  # EngineDeadError, RequestError: the request is over
            self._done = True
            raise
        if output.finished:
            self._done = True
        return output
