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
from trioserve.frontend.client import EngineCoreClient
from trioserve.frontend.outputs import RequestOutput
from trioserve.frontend.request_state import RequestState
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
    before this returns. If the engine dies while the block runs, requests
    raise ``EngineDeadError``; the block itself is not interrupted.
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
            client = EngineCoreClient(config)
            info: EngineInfo = await nursery.start(client.run)
            try:
                yield Engine(client, tokenizer, info)
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

    def __init__(self, client: EngineCoreClient, tokenizer: Tokenizer, info: EngineInfo) -> None:
        self._client = client
        self.tokenizer = tokenizer
        self.info = info
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(3)

    @property
    def config(self) -> EngineConfig:
        return self._client.config

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
        return RequestStream(self._client, RequestState(request_id, prompt_token_ids, params, self.tokenizer))

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
        """The engine core's counters (running and waiting requests, free KV blocks)."""
        return await self._client.stats()

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

    def __init__(self, client: EngineCoreClient, state: RequestState) -> None:
        self._client = client
        self._state = state
        self._done = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    async def __aenter__(self) -> RequestStream:
        """Submit the request. If cancelled, it was not submitted."""
        await self._client.submit(self._state)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
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
