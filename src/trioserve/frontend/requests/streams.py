"""A request as its caller holds it: ``RequestStream`` (one request) and
``ParentRequestStream`` (``n`` samples of one prompt). Both are async
context managers and async iterators of ``RequestOutput`` deltas; neither is
a bare async generator, so their cleanup follows the caller's scopes.

They reach the engine through a ``Submitter`` (``api.Engine``): it checks
prompts, builds request states and submits them to one engine core, all of
them or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

import trio

from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.requests.parallel_sampling import child_params, child_request_id
from trioserve.frontend.requests.state import RequestState
from trioserve.frontend.text.prompt import Prompt
from trioserve.messages import SamplingParams


class Submitter(Protocol):
    """What a stream needs of the engine."""

    async def check_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked (``InvalidRequestError`` otherwise)."""
        ...

    def new_state(
        self, request_id: str, token_ids: list[int], params: SamplingParams, client_id: str, index: int = 0
    ) -> RequestState: ...

    async def submit(self, states: Sequence[RequestState], engine_index: int | None = None) -> EngineCoreClient:
        """Submit every state to one engine core (``engine_index``'s, when
        given), or none (if cancelled, or if one fails); the client of the
        engine core they went to."""
        ...


class RequestStream:
    """One streaming request; an async context manager and an async iterator of
    ``RequestOutput`` deltas. Iteration ends after the output whose
    ``finish_reason`` is set. It is read by one task at a time
    (``trio.BusyResourceError`` for a second), inside its block
    (``RuntimeError`` outside it, unless the request had finished)."""

    def __init__(
        self,
        engine: Submitter,
        request_id: str,
        prompt: Prompt,
        token_ids: list[int] | None,
        params: SamplingParams,
        client_id: str,
        engine_index: int | None = None,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._target = engine_index
        self._prompt = prompt
        self._token_ids = token_ids  # None until a long text prompt is tokenized
        self._params = params
        self._client_id = client_id
        self._client: EngineCoreClient | None = None
        self._state: RequestState | None = None
        self._entering = False  # __aenter__ under way
        self._done = False
        self._exited = False  # its block has exited
        self._reader = _OneReader(f"request {request_id!r}")

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens (known once the block is entered)."""
        return 0 if self._token_ids is None else len(self._token_ids)

    @property
    def engine_index(self) -> int | None:
        """The engine core the request went to (once the block is entered)."""
        return None if self._client is None else self._client.engine_index

    async def __aenter__(self) -> RequestStream:
        """Check the prompt, if that is still to do, and submit the request.
        If cancelled, it was not submitted. A stream is entered once (its
        request runs once): ``RuntimeError`` the second time."""
        if self._state is not None or self._entering:
            raise RuntimeError(f"request {self.request_id!r}: a stream runs once; make a new one with engine.stream()")
        self._entering = True  # found: two tasks entering at once both submitted it (one copy orphaned)
        try:
            if self._token_ids is None:
                self._token_ids = await self._engine.check_prompt(self._prompt)
            state = self._engine.new_state(self.request_id, self._token_ids, self._params, self._client_id)
            self._client = await self._engine.submit([state], self._target)
            self._state = state  # once submitted: a refused stream may be entered again
        finally:
            self._entering = False
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exited = True
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
        if self._state is None or self._exited:
            raise RuntimeError(
                f"request {self.request_id!r}: iterate a RequestStream inside its async with block"
                + (" (it has exited: the request was aborted)" if self._exited else "")
            )
        with self._reader:
            try:
                output = await self._state.collector.get()
            except Exception:  # EngineDeadError, RequestError: the request is over
                self._done = True
                self._state.ended("error")
                raise
        if output.finished:
            self._done = True
        return output


class _OneReader:
    """Refuses a second task reading a stream while one does: outputs split
    between two readers, and one of them would wait for ever at the end."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._busy = False

    def __enter__(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(f"{self._what}: another task is already reading this stream")
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


class ParentRequestStream:
    """``n`` samples of one prompt (``Engine.stream_n``); an async context
    manager and an async iterator of ``RequestOutput`` deltas, each naming
    its sample by ``index``. Iteration ends once every sample has finished.

    Entering it submits every child to one engine core, or none: if one
    cannot be submitted (or entering is cancelled), none is left submitted.
    Leaving the block early, being cancelled, or a child failing aborts
    every child still running and frees its KV blocks. One task reads it at
    a time (``trio.BusyResourceError`` for a second).
    """

    def __init__(
        self,
        engine: Submitter,
        request_id: str,
        *,
        prompt: Prompt,
        token_ids: list[int] | None,
        params: SamplingParams,
        n: int,
        client_id: str,
        engine_index: int | None = None,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._target = engine_index
        self.n = n
        self._prompt = prompt
        self._token_ids = token_ids
        self._params = params
        self._client_id = client_id
        self._children: list[RequestState] = []
        self._entering = False  # __aenter__ under way
        self._running: dict[int, RequestState] = {}  # by index: submitted and not finished
        self._client: EngineCoreClient | None = None
        self._wakeup = trio.Event()
        self._next = 0  # the child to look at first, so that no sample starves the others
        self._reader = _OneReader(f"request {request_id!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return 0 if self._token_ids is None else len(self._token_ids)

    async def __aenter__(self) -> ParentRequestStream:
        """Check the prompt if still to do, and submit every child. If
        cancelled, none is left submitted. Entered once, as ``RequestStream``."""
        if self._children or self._entering:
            raise RuntimeError(
                f"request {self.request_id!r}: a stream runs once; make a new one with engine.stream_n()"
            )
        self._entering = True
        try:
            await self._submit()
        finally:
            self._entering = False
        return self

    async def _submit(self) -> None:
        if self._token_ids is None:
            self._token_ids = await self._engine.check_prompt(self._prompt)
        children = []
        for index in range(self.n):
            state = self._engine.new_state(
                child_request_id(self.request_id, index),
                self._token_ids,
                child_params(self._params, index),
                self._client_id,
                index,
            )
            state.collector.on_ready = self._wakeup.set
            children.append(state)
        self._client = await self._engine.submit(children, self._target)
        self._children = children
        self._running = dict(enumerate(children))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._abort_running()

    def _abort_running(self, finish_reason: str = "abort") -> None:
        """Abort every child still running; the observers hear ``finish_reason``."""
        for state in self._running.values():
            if self._client is not None:
                self._client.abort(state.request_id)
            state.ended(finish_reason)
        self._running.clear()

    def __aiter__(self) -> ParentRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta of any sample. If cancelled, nothing is lost. A
        child's error (``EngineDeadError``...) aborts the others and is raised."""
        if not self._children:
            raise RuntimeError("iterate a ParentRequestStream inside its async with block")
        with self._reader:
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
                self._abort_running("error")  # they fail with it: the parent request failed
                raise
            if output is not None:
                if output.finished:
                    del self._running[index]
                self._next = index + 1
                return output
        return None
