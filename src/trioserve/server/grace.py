"""How a running request of the HTTP API ends early: the shutdown grace
running out (``Grace``), or the engine aborting it (``check_not_aborted``),
both as ``Stopped``, which the endpoint answers with a 503 (or, in a
stream, an event holding it)."""

from __future__ import annotations

import trio

from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.requests.streams import RequestStream
from trioserve.server.openai_protocol import OpenAIError
from trioserve.server.state import ServerState


class Stopped(Exception):
    """The server ended a running request: the shutdown grace ended (code
    ``shutdown`` or ``engine_dead``), or the engine aborted it (``aborted``:
    generation paused, or put to sleep, with ``mode=abort``)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code

    def error(self) -> OpenAIError:
        why = {
            "engine_dead": "the engine died",
            "aborted": "the engine aborted it (generation was paused or put to sleep with mode=abort)",
        }.get(self.code, "the server is shutting down")
        return OpenAIError(503, f"{why}; the request was ended", type="server_error", code=self.code)


def check_not_aborted(out: RequestOutput) -> None:
    """OpenAI's finish reasons are ``stop`` and ``length``: a request the
    engine aborted is an error for its client (retry once it resumes), never
    a short answer that looks whole."""
    if out.finish_reason == "abort":
        raise Stopped("aborted")


class Grace:
    """Ends one request's wait for its next output once the shutdown grace
    is over; never a write, so a response is never cut mid-event."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._waiting: trio.CancelScope | None = None
        self._over = False

    async def watch(self) -> None:
        """Run beside the request. Cancelling leaves nothing behind."""
        await self._state.grace_over.wait()
        self._over = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def next_output(self, stream: RequestStream) -> RequestOutput | None:
        """``stream``'s next output (None at its end); raises ``Stopped``
        once the grace is over (the request is aborted when its block is
        left). If cancelled, nothing is lost."""
        with trio.CancelScope() as waiting:
            if self._over:
                waiting.cancel()
            self._waiting = waiting
            try:
                return await stream.__anext__()
            except StopAsyncIteration:
                return None
            finally:
                self._waiting = None
        raise Stopped(self._state.stop_code)
