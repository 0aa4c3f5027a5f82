"""The public face for Trio programs: ``open_engine``, ``Engine``, ``RequestStream``.

This is the one place where exception groups from inside the project are
collapsed into plain exceptions (``EngineStartupError``, ``EngineDeadError``,
``RequestError``, ``ValueError``, or the caller's own exception).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, EngineStartupError, InvalidRequestError, collapse
from trioserve.frontend.chat_template import ChatTemplate, TemplatedText
from trioserve.frontend.client import EngineCoreClient
from trioserve.frontend.model_dir import load_model_dir
from trioserve.frontend.outputs import RequestMetrics, RequestOutput
from trioserve.frontend.parallel_sampling import check_n, child_params, child_request_id
from trioserve.frontend.prompt import Prompt, PromptChecker
from trioserve.frontend.request_state import RequestState
from trioserve.frontend.supervisor import EngineSupervisor, Health
from trioserve.frontend.tokenizer import Tokenizer
from trioserve.messages import EngineInfo, EngineStats, SamplingParams

log = logging.getLogger("trioserve.api")
RequestObserver = Callable[[RequestMetrics], None]


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
    tokenizer, chat_template = await trio.to_thread.run_sync(_load_tokenizer, config)
    try:
        async with trio.open_nursery() as nursery:
            supervisor = EngineSupervisor(config)
            await nursery.start(supervisor.run)
            try:
                yield Engine(supervisor, tokenizer, chat_template)
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def _load_tokenizer(config: EngineConfig) -> tuple[Tokenizer, ChatTemplate | None]:
    """The model directory's tokenizer and chat template, once the directory
    is checked; a missing or broken one is a start-up error naming the path."""
    try:
        tokenizer = load_model_dir(config.model, needs_weights=config.runner == "hf")
        return tokenizer, ChatTemplate.from_dir(config.model)
    except (OSError, ValueError) as exc:  # each names the directory or the file
        raise EngineStartupError(str(exc), stage="tokenizer") from None


class Engine:
    """A running engine. Get one from ``open_engine``."""

    def __init__(
        self, supervisor: EngineSupervisor, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None
    ) -> None:
        self._supervisor = supervisor
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the model's own, or None
        self._prompts = PromptChecker(tokenizer, self.info)
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(3)
        self._observers: list[RequestObserver] = []

    def add_request_observer(self, observer: RequestObserver) -> None:
        """Call ``observer`` (synchronously; it must not block) with each
        request's ``RequestMetrics`` when it ends, however it ends."""
        self._observers.append(observer)

    def _request_ended(self, metrics: RequestMetrics) -> None:
        for observer in self._observers:
            try:
                observer(metrics)
            except Exception:  # an observer's bug must not fail a request
                log.exception("a request observer failed")

    def render_chat(
        self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
    ) -> TemplatedText:
        """The prompt for chat ``messages`` (mappings with ``role`` and
        ``content``), rendered with the model's chat template; give it to
        ``stream`` as the prompt. Raises ``InvalidRequestError`` naming
        ``messages`` when the model has no template or it refuses them."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "messages", "this model has no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

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
        self._check_request(params, client_id)
        token_ids = None if self._prompts.needs_thread(prompt) else self._prompts.check(prompt)
        return RequestStream(self, self._new_id(), prompt, token_ids, params, client_id)

    def stream_n(
        self, prompt: Prompt, params: SamplingParams | None = None, n: int = 1, *, client_id: str = ""
    ) -> ParentRequestStream:
        """``n`` samples of one prompt, streamed together: a parent request
        fanned out into ``n`` requests in the engine. Each ``RequestOutput``
        says which sample it belongs to (``index``). With ``params.seed``,
        sample ``i`` uses ``seed + i``. Checks as ``stream`` (and ``n``, in
        [1, 128]); leaving the block early, or being cancelled, aborts every
        sample still running.
        """
        params = SamplingParams() if params is None else params
        self._check_request(params, client_id)
        n = check_n(n)
        token_ids = None if self._prompts.needs_thread(prompt) else self._prompts.check(prompt)
        return ParentRequestStream(
            self, self._new_id(), prompt=prompt, token_ids=token_ids, params=params, n=n, client_id=client_id
        )

    def _check_request(self, params: object, client_id: object) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be a SamplingParams (got {type(params).__name__})")
        if not isinstance(client_id, str):
            raise InvalidRequestError("client_id", f"must be a string (got {type(client_id).__name__})")

    def _new_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

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

    async def reset_prefix_cache(self) -> int:
        """Make the engine forget every cached prefix (after new weights, say,
        or to measure without it); requests running keep their blocks.
        Returns how many cached blocks were forgotten. While the engine
        restarts, waits for it like a request (a restarted engine starts with
        an empty cache)."""
        client = await self._supervisor.ready_client()
        return await client.reset_prefix_cache()

    def num_requests_in_flight(self) -> int:
        """Requests the front-end holds state for (submitted and not yet over)."""
        client = self._supervisor.client
        return 0 if client is None else len(client.requests)

    def _new_state(
        self, request_id: str, token_ids: list[int], params: SamplingParams, client_id: str, index: int = 0
    ) -> RequestState:
        return RequestState(
            request_id,
            token_ids,
            params,
            self.tokenizer,
            client_id=client_id,
            index=index,
            on_end=self._request_ended if self._observers else None,
        )

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
        self._state = self._engine._new_state(self.request_id, self._token_ids, self._params, self._client_id)
        self._client = await self._engine._submit(self._state)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done and self._client is not None:
            self._client.abort(self.request_id)
            if self._state is not None:
                self._state.ended("abort")

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
            self._state.ended("error")
            raise
        if output.finished:
            self._done = True
        return output


class ParentRequestStream:
    """``n`` samples of one prompt (``Engine.stream_n``); an async context
    manager and an async iterator of ``RequestOutput`` deltas, each naming
    its sample by ``index``. Iteration ends once every sample has finished.

    Entering it submits every child, or none: if one cannot be submitted
    (or entering is cancelled), those already submitted are aborted.
    Leaving the block early, being cancelled, or a child failing aborts
    every child still running and frees its KV blocks.
    """

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        *,
        prompt: Prompt,
        token_ids: list[int] | None,
        params: SamplingParams,
        n: int,
        client_id: str,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self.n = n
        self._prompt = prompt
        self._token_ids = token_ids
        self._params = params
        self._client_id = client_id
        self._children: list[RequestState] = []
        self._running: dict[int, RequestState] = {}  # by index: submitted and not finished
        self._client: EngineCoreClient | None = None
        self._wakeup = trio.Event()
        self._next = 0  # the child to look at first, so that no sample starves the others

    @property
    def num_prompt_tokens(self) -> int:
        return 0 if self._token_ids is None else len(self._token_ids)

    async def __aenter__(self) -> ParentRequestStream:
        """Check the prompt if still to do, and submit every child. If
        cancelled, none is left submitted."""
        if self._token_ids is None:
            self._token_ids = await self._engine._prompts.check_async(self._prompt)
        try:
            for index in range(self.n):
                state = self._engine._new_state(
                    child_request_id(self.request_id, index),
                    self._token_ids,
                    child_params(self._params, index),
                    self._client_id,
                    index,
                )
                state.collector.on_ready = self._wakeup.set
                self._client = await self._engine._submit(state)
                self._children.append(state)
                self._running[index] = state
        except BaseException:
            self._abort_running()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._abort_running()

    def _abort_running(self) -> None:
        for state in self._running.values():
            if self._client is not None:
                self._client.abort(state.request_id)
            state.ended("abort")
        self._running.clear()

    def __aiter__(self) -> ParentRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta of any sample. If cancelled, nothing is lost. A
        child's error (``EngineDeadError``...) aborts the others and is raised."""
        if not self._children:
            raise RuntimeError("iterate a ParentRequestStream inside its async with block")
        while self._running:
            output = self._poll()
            if output is not None:
                return output
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            for state in self._children:
                state.collector.on_ready = self._wakeup.set
        raise StopAsyncIteration

    def _poll(self) -> RequestOutput | None:
        indexes = sorted(self._running)
        start = next((i for i, index in enumerate(indexes) if index >= self._next), 0)
        for index in indexes[start:] + indexes[:start]:
            state = self._running[index]
            try:
                output = state.collector.poll()
            except Exception:
                del self._running[index]
                state.ended("error")
                self._abort_running()
                raise
            if output is not None:
                if output.finished:
                    del self._running[index]
                self._next = index + 1
                return output
        return None
