"""Requests that outlive the engine core they ran on.

When an engine core dies, its client hands the requests it had in flight to
``Resumptions.orphaned``. Each one that may be resumed is sent to a ready
engine core (the least loaded, or, for a request that asked for an engine,
that engine's next life), waiting for one at most ``restart_wait_s`` as a
new request does, as a continuation: its prompt, and every token it
received as output (``RequestState.add_request``), so that its stream goes
on where it stopped. Its consumer sees a pause, no error; greedy and seeded
requests go on with the very tokens they would have produced.

A request is not resumed, and ends with the ``EngineDeadError`` it ends
with today, when ``resume_requests`` is off, when it was already resumed
``max_resumes`` times (so that a request that kills every engine it runs on
cannot kill them all for ever), when its consumer is done with it, when no
engine is ready within ``restart_wait_s`` (or every one failed), or when its
prompt and tokens so far do not fit the context of the engine it would go
to. The requests of one death that may go to the same engines (any ready
one; or one engine, asked for) are resumed in the order they were in, one
after another, by a task of this actor's nursery: when no engine is ready
for one of them within ``restart_wait_s``, none is for the others either,
and they all end then.

Task tree::

    Resumptions.run          (in the engine group's nursery)
    └── _resume × deaths     one per engine-core death, and engine asked for, with requests to resume
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.requests.state import RequestState

log = logging.getLogger("trioserve.resume")
# A ready engine core's client for a request (None: any engine; else that engine's), and its request wave.
Route = Callable[[int | None], Awaitable[tuple[EngineCoreClient, int]]]


class Resumptions:
    """Resumes the requests of engine cores that die (see the module docstring)."""

    def __init__(self, config: EngineConfig, route: Route) -> None:
        self.config = config
        self._route = route
        self._nursery: trio.Nursery | None = None
        self._waiting: set[RequestState] = set()  # of dead engine cores, neither sent on again nor ended yet

    @property
    def num_waiting(self) -> int:
        """The requests waiting to be resumed (not those their consumers left meanwhile)."""
        return sum(not state.aborted for state in self._waiting)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take orphans until cancelled. If cancelled, the requests still
        waiting to be resumed end with ``EngineDeadError``."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def orphaned(self, dead: EngineCoreClient, states: list[RequestState]) -> None:
        """``dead``'s engine core died with ``states`` in flight: resume those
        that may be, end the others. Never blocks."""
        error = dead.dead or EngineDeadError(f"{dead.name} died")
        resumable: dict[int | None, list[RequestState]] = {}  # by the engine they may go to (None: any)
        for state in states:
            if state.aborted:
                continue
            if not self.config.resume_requests or self._nursery is None:
                state.collector.fail(error)
            elif state.num_resumes >= self.config.max_resumes:
                state.collector.fail(
                    EngineDeadError(
                        f"{error}; request {state.request_id!r} was resumed {state.num_resumes} time(s) already "
                        f"(max_resumes={self.config.max_resumes}): not again"
                    )
                )
            else:
                resumable.setdefault(state.target, []).append(state)
        for same_engines in resumable.values():
            assert self._nursery is not None
            self._waiting.update(same_engines)
            self._nursery.start_soon(self._resume, dead.name, error, same_engines)

    async def _resume(self, dead: str, error: EngineDeadError, states: list[RequestState]) -> None:
        """Send each of ``states`` (which may go to the same engines) to a
        ready engine core, in order. If cancelled, or when no engine is ready
        for one, those not sent yet end with ``error``."""
        left = list(states)
        why = ""
        try:
            while left:
                state = left[0]
                if not state.aborted:
                    why = await self._resume_one(dead, error, state)
                    if why:
                        break
                self._waiting.discard(left.pop(0))
        finally:
            for state in left:
                self._waiting.discard(state)
                _end(state, error, why)

    async def _resume_one(self, dead: str, error: EngineDeadError, state: RequestState) -> str:
        """Send ``state`` to a ready engine core as a continuation (or end it,
        if it cannot go there); why no engine is ready for it, in which case
        none is for the requests after it, else ``""``."""
        while True:
            try:
                client, wave = await self._route(state.target)
            except (EngineDeadError, InvalidRequestError) as exc:  # (the engine it asked for is being removed)
                return str(exc)
            if state.aborted:
                return ""  # its consumer left while it waited
            total = len(state.prompt_token_ids) + len(state.output_token_ids)
            context = client.info.max_model_len if client.info is not None else total + 1
            if total >= context:
                _end(state, error, f"its prompt and {len(state.output_token_ids)} tokens so far ({total}) leave no "
                                   f"room in {client.name}'s context (max_model_len={context})")  # fmt: skip
                return ""
            state.engine_index = client.engine_index
            state.num_resumes += 1
            try:
                await client.submit(state, wave, resumed=True)
            except EngineDeadError:
                state.num_resumes -= 1  # that one died too before it got there: the next ready one
                continue
            except (InvalidRequestError, EngineOverloadedError) as exc:
                _end(state, error, str(exc))
                return ""
            log.warning(
                "request %r: %s died; resumed on %s with %d tokens so far (resumption %d of at most %d)",
                state.request_id, dead, client.name, len(state.output_token_ids), state.num_resumes,
                self.config.max_resumes,
            )  # fmt: skip
            return ""


def _end(state: RequestState, error: EngineDeadError, why: str) -> None:
    """End ``state`` (unless its consumer left it) with its engine core's
    death, and why it could not be resumed, if that is known."""
    if not state.aborted:
        state.collector.fail(
            EngineDeadError(f"{error}; request {state.request_id!r} could not be resumed: {why}") if why else error
        )
