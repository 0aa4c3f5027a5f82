"""A request as its caller holds it: ``RequestStream``, ``n`` samples of one
prompt (``Engine.stream`` makes one, ``Engine.stream_n`` several). It is an
async context manager and an async iterator of ``RequestOutput`` deltas,
not a bare async generator, so its cleanup follows the caller's scopes.

Each sample is a request in the engine (``parallel_sampling.py``): the one
of ``Engine.stream`` runs under the stream's own request id, those of
``Engine.stream_n`` as ``{id}-{i}``. The stream reaches the engine through
a ``RequestRouter`` (``router.py``), which checks the prompt, builds the
samples' states and submits them to one engine core, all of them or none.

Invariants: the samples are submitted once (a stream runs once); a sample
is running from its submission until its last output was taken, it failed,
or it was aborted; when the block is left, none is running. A sample whose
engine core dies may be resumed on another (``frontend/engines/resume.py``):
it runs on, in the same mailbox, and it is aborted wherever it is.
"""

from __future__ import annotations

from types import TracebackType

import trio

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.requests.parallel_sampling import child_params, child_request_id
from trioserve.frontend.requests.router import RequestRouter
from trioserve.frontend.requests.state import RequestState
from trioserve.frontend.text.prompt import Prompt
from trioserve.sampling_params import SamplingParams


class RequestStream:
    """``n`` samples of one prompt, streamed together: an async context
    manager and an async iterator of ``RequestOutput`` deltas, each naming
    its sample by ``index``. Iteration ends once every sample has finished.

    Entering it submits every sample to one engine core, or none: if one
    cannot be submitted (or entering is cancelled), none is left submitted.
    Leaving the block early, being cancelled, or a sample failing aborts
    every sample still running and frees its KV blocks. It is read by one
    task at a time (``trio.BusyResourceError`` for a second), inside its
    block (``RuntimeError`` after it, unless every sample had finished).

    ``n`` None: one request under ``request_id`` (``Engine.stream``); else
    ``n`` samples named ``{request_id}-{i}`` (``Engine.stream_n``).
    """

    def __init__(
        self,
        router: RequestRouter,
        request_id: str,
        prompt: Prompt,
        token_ids: list[int] | None,
        params: SamplingParams,
        *,
        client_id: str = "",
        engine_index: int | None = None,
        n: int | None = None,
        more_prompts: list[tuple[Prompt, list[int] | None]] | None = None,
    ) -> None:
        """``more_prompts``: a batch (``Engine.stream_prompts``): the prompts
        after the first, each with its token ids (None: still to check), each
        sampled ``n`` times; sample ``j`` of prompt ``p`` is ``index p * n + j``."""
        self._router = router
        self.request_id = request_id
        self._per_prompt = 1 if n is None else n
        self._fanned_out = n is not None or bool(more_prompts)
        self._target = engine_index
        self._prompts: list[Prompt] = [prompt, *(p for p, _ in more_prompts or [])]
        # Each prompt's ids: None until a long text prompt is tokenized.
        self._prompt_ids: list[list[int] | None] = [token_ids, *(ids for _, ids in more_prompts or [])]
        self.n = self._per_prompt * len(self._prompts)
        self._params = params
        self._client_id = client_id
        self._samples: list[RequestState] = []  # once submitted
        self._running: dict[int, RequestState] = {}  # by index: submitted and not over
        self._entering = False  # __aenter__ under way
        self._held = 0  # entries counted in the router's HeldEntries while it is entered (held.py)
        self._cut_short = False  # its block exited while a sample was running: those were aborted
        self._wakeup = trio.Event()
        self._next = 0  # the sample to look at first, so that none starves the others
        self._reader = _OneReader(f"request {request_id!r}")

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens (a batch's: all its prompts'; known once the block is entered)."""
        return sum(len(ids) for ids in self._prompt_ids if ids is not None)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The (first) prompt's token ids (known once the block is entered; empty before)."""
        first = self._prompt_ids[0]
        return [] if first is None else list(first)

    @property
    def engine_index(self) -> int | None:
        """The engine core the samples went to (once the block is entered;
        the first sample's, where it was resumed last if its engine core died)."""
        return self._samples[0].engine_index if self._samples else None

    async def __aenter__(self) -> RequestStream:
        """Check the prompt, if that is still to do, and submit every sample.
        If cancelled, none is left submitted. A stream is entered once (its
        request runs once): ``RuntimeError`` the second time."""
        if self._samples or self._entering:
            maker = "stream_n" if self._fanned_out else "stream"
            raise RuntimeError(f"request {self.request_id!r}: a stream runs once; make a new one with engine.{maker}()")
        self._entering = True  # a second task entering meanwhile must not submit it again
        try:
            checked: list[list[int]] = []
            for prompt, ids in zip(self._prompts, self._prompt_ids, strict=True):
                checked.append(ids if ids is not None else await self._router.check_prompt(prompt))
            self._prompt_ids = list(checked)
            samples = [
                self._new_sample(ids, p * self._per_prompt + j, j)
                for p, ids in enumerate(checked)
                for j in range(self._per_prompt)
            ]
            entries = sum(self._router.entries(self._params, self._per_prompt, len(ids)) for ids in checked)
            self._router.held.take(entries)  # raises if it may hold too much, alone or beside the others
            try:
                await self._router.submit(samples, self._target)
            except BaseException:
                self._router.held.give(entries)
                raise
            self._held = entries
            self._samples = samples  # once submitted: a refused stream may be entered again
            self._running = dict(enumerate(samples))
        finally:
            self._entering = False
        return self

    def _new_sample(self, token_ids: list[int], index: int, sample: int) -> RequestState:
        """Sample ``sample`` of its prompt, ``index`` in the stream."""
        request_id = child_request_id(self.request_id, index) if self._fanned_out else self.request_id
        params = child_params(self._params, sample)
        state = self._router.new_state(request_id, token_ids, params, self._client_id, index)
        state.collector.on_ready = self._wake
        return state

    def _wake(self) -> None:
        self._wakeup.set()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._cut_short = bool(self._running)
        self._abort_running()
        self._router.held.give(self._held)
        self._held = 0

    def _abort_running(self, finish_reason: str = "abort") -> None:
        """Abort every sample still running; the observers hear ``finish_reason``."""
        for state in self._running.values():
            state.abort()
            state.ended(finish_reason)
        self._running.clear()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta of any sample. If cancelled, nothing is lost: it
        stays for the next call. A sample's error (``EngineDeadError``,
        ``RequestError``) aborts the others and is raised."""
        if not self._samples or self._cut_short:
            raise RuntimeError(
                f"request {self.request_id!r}: iterate a RequestStream inside its async with block"
                + (" (it has exited: the request was aborted)" if self._cut_short else "")
            )
        if not self._running:
            raise StopAsyncIteration
        with self._reader:
            while self._running:
                output = self._poll()
                if output is not None:
                    return output
                await self._wakeup.wait()
                self._wakeup = trio.Event()
        raise StopAsyncIteration

    def _poll(self) -> RequestOutput | None:
        indexes = sorted(self._running)
        start = next((i for i, index in enumerate(indexes) if index >= self._next), 0)
        for index in indexes[start:] + indexes[:start]:
            state = self._running[index]
            try:
                output = state.collector.poll()
            except Exception:  # EngineDeadError, RequestError: the request is over
                del self._running[index]
                state.ended("error")
                self._abort_running("error")  # the others fail with it: the request failed
                raise
            if output is not None:
                if output.finished:
                    del self._running[index]
                self._next = index + 1
                return output
        return None


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
