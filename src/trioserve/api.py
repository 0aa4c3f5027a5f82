"""The public face for Trio programs: ``open_engine``, ``Engine``, ``RequestStream``.

This is the one place where exception groups from inside the project are
collapsed into plain exceptions (``EngineStartupError``, ``EngineDeadError``,
``RequestError``, ``ValueError``, or the caller's own exception).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError
from trioserve.frontend.client import EngineCoreClient
from trioserve.frontend.outputs import RequestOutput
from trioserve.frontend.request_state import RequestState
from trioserve.frontend.supervisor import EngineSupervisor, Health
from trioserve.frontend.tokenizer import Tokenizer
from trioserve.messages import EngineInfo, EngineStats, SamplingParams

Prompt = str | Sequence[int]


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
    tokenizer = await trio.to_thread.run_sync(Tokenizer.from_dir, config.model)
    try:
        async with trio.open_nursery() as nursery:
            supervisor = EngineSupervisor(config)
            await nursery.start(supervisor.run)
            try:
                yield Engine(supervisor, tokenizer)
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _collapse(group) from None


def _collapse(group: BaseExceptionGroup) -> BaseException:
    """The single exception a caller should see for ``group``."""
    leaves = list(_leaves(group))
    meaningful = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    if len(meaningful) == 1:
        return meaningful[0]
    if not meaningful:
        return leaves[0]
    return group


def _leaves(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


class Engine:
    """A running engine. Get one from ``open_engine``."""

    def __init__(self, supervisor: EngineSupervisor, tokenizer: Tokenizer) -> None:
        self._supervisor = supervisor
        self.tokenizer = tokenizer
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
        """``ready``, ``restarting`` (the engine core died and is being
        restarted), ``failed`` (out of restarts: for good) or ``stopped``."""
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

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """A request whose outputs arrive as they are produced.

        Use as ``async with engine.stream(prompt, params) as stream: async for
        out in stream: ...``. Invalid input raises ``ValueError`` naming the
        field, here, before anything is sent. Leaving the block before the
        request finished, or being cancelled, aborts it in the engine and
        frees its KV blocks.
        """
        params = params if params is not None else SamplingParams()
        prompt_token_ids = self._prompt_token_ids(prompt)
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        return RequestStream(self._supervisor, RequestState(request_id, prompt_token_ids, params, self.tokenizer))

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

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.info.vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids must be integers in [0, {self.info.vocab_size}) (got {bad[0]!r})")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if len(token_ids) >= self.info.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens does not fit the context of {self.info.max_model_len} "
                "tokens (max_model_len), which must also hold at least one output token"
            )
        return token_ids


class RequestStream:
    """One streaming request; an async context manager and an async iterator of
    ``RequestOutput`` deltas. Iteration ends after the output whose
    ``finish_reason`` is set."""

    def __init__(self, supervisor: EngineSupervisor, state: RequestState) -> None:
        self._supervisor = supervisor
        self._client: EngineCoreClient | None = None
        self._state = state
        self._done = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    async def __aenter__(self) -> RequestStream:
        """Submit the request (waiting for a restarting engine at most
        ``restart_wait_s``). If cancelled, it was not submitted."""
        client = await self._supervisor.ready_client()
        await client.submit(self._state)
        self._client = client
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done and self._client is not None:
            self._client.abort(self._state.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta. If cancelled, nothing is lost: it stays for the next call."""
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._state.collector.get()
        except Exception:  # EngineDeadError, RequestError: the request is over
            self._done = True
            raise
        if output.finished:
            self._done = True
        return output
