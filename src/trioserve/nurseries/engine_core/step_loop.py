"""The engine core's step loop: a scheduler fed from an inbox, its steps run by the executor, their outputs and
every reply to the front-end sent to an outbox.

Invariants:
- the step loop owns the one queue of steps sent to the workers and not yet postprocessed, oldest first; the
  executor is handed each step (``dispatch``, ``collect``) and asks for the queue (``steps_in_flight``) only to
  name the step a worker was running and to refuse a call to the workers while steps are in flight;
- at most ``max_steps_in_flight`` steps are in flight (one in lockstep); they are collected and postprocessed in
  the order they were sent;
- the step loop owns the one queue of replies not yet sent: the controller (``control.py``) returns its replies
  and the step loop queues them with its own, in the order they were made;
- the tokens postprocessed go out before the replies queued with them (a request that ended before a pause had
  its last token sent before the pause is answered); a step's tokens go out once the step after it is on its way,
  or when no step follows;
- a step that samples under a constraint gets its bitmask (``GrammarBitmask``) the moment it is the oldest step in
  flight: every token before it is postprocessed, so the matchers are where its rows sample from. The workers run
  its forward pass meanwhile and wait for the bitmask only to sample;
- grammars compile in the step loop's own nursery (``structured_outputs.py``), off the Trio thread; their results
  are handed to the scheduler between steps, and an idle step loop wakes for them as for a message.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import deque
from collections.abc import Sequence

import trio

from trioserve.core import waves
from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.core.step import Step
from trioserve.core.waves import EngineWaves
from trioserve.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineResponse,
    GetStats,
    LoadReport,
    PrefixCacheReset,
    ResetPrefixCache,
    StartWave,
    TokenOutput,
    WaveNotice,
)
from trioserve.nurseries.engine_core.control import Controller
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.grammar import Tokenizer
from trioserve.nurseries.engine_core.structured_outputs import Result, StructuredOutputs
from trioserve.rpc import ControlRequest

LOAD_REPORT_INTERVAL_S = 0.02  # the most often the load goes out when it changes
_NO_SPAN = contextlib.nullcontext()  # while no profile is recorded


class EngineCore:
    """The step loop: a scheduler fed from an inbox, its steps run by the
    executor, the outputs sent to an outbox. It owns the steps in flight
    (sent to the workers and not yet postprocessed) and the replies not yet
    sent."""

    def __init__(
        self, scheduler: Scheduler, executor: Executor, info: EngineInfo, waves: EngineWaves | None = None
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.info = info
        self._in_flight: deque[Step] = deque()  # oldest first
        # Lockstep (core/waves.py): step while the wave runs, one step at a time, since
        # whether the next one is due depends on the last one's collective.
        self.waves = waves
        self.depth = 1 if waves is not None else executor.config.max_steps_in_flight
        self._unsent: list[TokenOutput] = []  # outputs of the last step postprocessed, not yet in the outbox
        self._replies: deque[EngineResponse] = deque()  # answers to front-end messages, not yet in the outbox
        self.control = Controller(scheduler, executor)  # pause, sleep, calls to the workers
        self._last_load = LoadReport(num_waiting=0, num_running=0)
        self._last_load_at = -math.inf
        text_dir = executor.config.tokenizer or executor.config.model  # --tokenizer's, as the front-end's
        tokenizer = Tokenizer(os.path.join(text_dir, "tokenizer.json"), info.vocab_size, info.eos_token_ids)
        self.structured = StructuredOutputs(tokenizer, info.vocab_size)
        self._compiles: trio.Nursery | None = None  # where grammars compile: the step loop's

    def steps_in_flight(self) -> Sequence[Step]:
        """The steps sent to the workers and not yet postprocessed, oldest first (to read, not to keep)."""
        return self._in_flight

    async def step_loop(
        self, inbox: trio.MemoryReceiveChannel[EngineRequest], outbox: trio.MemorySendChannel[EngineResponse]
    ) -> None:
        """Run steps while there is work; sleep on the inbox when there is none.

        Each turn: take what the front-end sent; plan and send the next step
        (up to ``max_steps_in_flight`` are with the workers at once, so they
        go from one step straight to the next); send the last step's outputs
        to the front-end, once the step after it is on its way; then wait
        for the oldest step and postprocess it. A control call that can run
        (``nurseries/engine_core/control.py``) runs first, once the steps in flight are
        collected. If cancelled, steps still in flight are dropped with the
        workers, and grammar compiles are abandoned.
        """
        async with trio.open_nursery() as self._compiles:
            await self._run(inbox, outbox)

    async def _run(
        self, inbox: trio.MemoryReceiveChannel[EngineRequest], outbox: trio.MemorySendChannel[EngineResponse]
    ) -> None:
        while True:
            await self._wait_for_work(inbox, outbox)
            self._take_messages(inbox)
            self._take_grammars()
            if self.control.has_ready():
                while self._in_flight:
                    await self._collect_oldest()
                self._replies.extend(await self.control.run_ready())
                for request in self.control.release_held():
                    self._admit(request)
            sent = await self._plan_and_send()
            await self._send_outputs(outbox)
            if self._in_flight and (len(self._in_flight) == self.depth or not sent):
                await self._collect_oldest()
            elif not self._in_flight:
                await trio.lowlevel.checkpoint()

    async def _wait_for_work(
        self, inbox: trio.MemoryReceiveChannel[EngineRequest], outbox: trio.MemorySendChannel[EngineResponse]
    ) -> None:
        """When nothing is in flight, unfinished or ready to run (and, in
        lockstep, no wave runs), flush the outputs and sleep on the inbox."""
        if not self._in_flight and not self._due() and not self.control.has_ready():
            await self._send_outputs(outbox)
            if (msg := await self._next_message(inbox)) is not None:
                self.apply(msg)

    async def _next_message(self, inbox: trio.MemoryReceiveChannel[EngineRequest]) -> EngineRequest | None:
        """The next front-end message; or None, once a grammar compiled first."""
        if self.structured.has_results:
            return None  # a compile ended while the last step ran
        if not self.structured.compiling:
            return await inbox.receive()
        received: EngineRequest | None = None
        async with trio.open_nursery() as nursery:

            async def take() -> None:
                nonlocal received
                received = await inbox.receive()
                nursery.cancel_scope.cancel()

            async def compiled() -> None:
                await self.structured.wait_results()
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
            nursery.start_soon(compiled)
        return received

    def _due(self) -> bool:
        """Is a step due? When a request can run (not only wait for its grammar),
        and in lockstep while the wave runs."""
        if self.waves is None:
            return self.scheduler.has_schedulable()
        return self.waves.should_step(self.scheduler.has_unfinished())

    def _take_grammars(self) -> None:
        """Hand the compiles that ended to the scheduler: a request with its
        matcher is queued, one whose constraint did not compile ends with the error."""
        for request, result in self.structured.take_results():
            self._constrain(request, result)

    def _constrain(self, request: Request, result: Result) -> None:
        """Give ``request`` its matcher (moved past a continuation's tokens so
        far), or end it with why it has none."""
        if not isinstance(result, str):
            refused = request.replay(result)
            if refused is None:
                self.scheduler.grammar_ready(request, result)
                return
            result = refused
        if (error := self.scheduler.grammar_failed(request, result)) is not None:
            self._unsent.append(error)

    def _take_messages(self, inbox: trio.MemoryReceiveChannel[EngineRequest]) -> None:
        while True:
            try:
                self.apply(inbox.receive_nowait())
            except trio.WouldBlock:
                return

    async def _plan_and_send(self) -> bool:
        """Plan the next step and send it to the workers, if there is room in
        flight and work to do. True when a step was sent."""
        if len(self._in_flight) >= self.depth or not self._due():
            return False
        with self._span("schedule"):
            step = self.scheduler.schedule(always=self.waves is not None)
        if step is not None and self.waves is not None:
            step.scheduled.dp_unfinished = self.scheduler.has_unfinished()
        if step is None:
            return False
        with self._span("send", step.number):
            await self.executor.dispatch(step)
        self._in_flight.append(step)
        if len(self._in_flight) == 1:
            await self._send_bitmask(step)
        return True

    async def _send_bitmask(self, step: Step) -> None:
        """``step``'s bitmask, if it samples under a constraint (it must be the oldest step in flight)."""
        if step.scheduled.awaits_bitmask:
            live = self.scheduler.get_request
            await self.executor.send_bitmask(
                self.structured.bitmask(step.samplers, lambda req: live(req.request_id) is req)
            )

    async def _collect_oldest(self) -> None:
        step = self._in_flight[0]
        with self._span("wait", step.number):
            runner_output = await self.executor.collect(step)
        self._in_flight.popleft()
        with self._span("postprocess", step.number):
            self._unsent += self.scheduler.postprocess(step, runner_output)
        if self._in_flight:
            await self._send_bitmask(self._in_flight[0])
        if self.waves is not None:
            done = self.waves.stepped(bool(runner_output.dp_any_unfinished))
            if done is not None:
                self._replies.append(WaveNotice(kind="complete", wave=done.wave, engine=self.waves.engine))

    def _span(self, name: str, step: int | None = None) -> contextlib.AbstractContextManager[None]:
        """While a profile is recorded (``StartProfile``), the time of the
        ``with`` block as span ``name`` of the engine core's trace."""
        trace = self.control.trace
        return _NO_SPAN if trace is None else trace.span(name, step)

    async def _send_outputs(self, outbox: trio.MemorySendChannel[EngineResponse]) -> None:
        """Tokens first, then replies: a request that ended before a pause
        had its last token sent before the pause is answered."""
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            await outbox.send(EngineOutputs(outputs=outputs))
        while self._replies:
            await outbox.send(self._replies.popleft())
        if (report := self._load_changed()) is not None:
            await outbox.send(report)

    def load(self) -> LoadReport:
        num_waiting = self.scheduler.num_waiting + self.control.num_held
        return LoadReport(num_waiting=num_waiting, num_running=self.scheduler.num_running)

    def _load_changed(self) -> LoadReport | None:
        """The load, when it changed since the last report and the last
        report is at least ``LOAD_REPORT_INTERVAL_S`` old (the heartbeats
        carry it too, so a change held back here goes out with the next)."""
        now = trio.current_time()
        load = self.load()
        if load == self._last_load or now < self._last_load_at + LOAD_REPORT_INTERVAL_S:
            return None
        self._last_load, self._last_load_at = load, now
        return load

    def apply(self, msg: EngineRequest) -> None:
        """Apply one front-end message; its reply, if any, goes out with the next outputs."""
        if isinstance(msg, AddRequest):
            if self.control.admitting:
                self._admit(msg)
            else:
                self._replies.extend(self.control.hold(msg))
        elif isinstance(msg, StartWave):
            if self.waves is not None:
                self.waves.start_wave(waves.StartWave(msg.wave, msg.exclude))
        elif isinstance(msg, AbortRequests):
            self.control.drop_held(msg.request_ids)
            self.scheduler.abort(msg.request_ids)
        elif isinstance(msg, ResetPrefixCache):
            num_blocks = self.scheduler.reset_prefix_cache()
            self._replies.append(PrefixCacheReset(call_id=msg.call_id, num_blocks=num_blocks))
        elif isinstance(msg, GetStats | ControlRequest):
            self._replies.extend(self.control.submit(msg))

    def _admit(self, msg: AddRequest) -> None:
        """Give a request to the scheduler; in lockstep, its wave stamp may
        ask the other engines to start a wave."""
        self._add(msg)
        if self.waves is not None and (notice := self.waves.add_request(msg.wave)) is not None:
            self._replies.append(WaveNotice(kind="start_requested", wave=notice.wave, engine=notice.engine))

    def _add(self, msg: AddRequest) -> None:
        try:
            request = Request(
                msg.request_id, msg.prompt_token_ids, msg.params, self.info.eos_token_ids, msg.client_id,
                output_token_ids=msg.output_token_ids,
            )  # fmt: skip
            request.lora_key = self.scheduler.adapters.key_of(msg.params.lora)
            self.scheduler.add(request)
        except ValueError as exc:
            # The front-end validates first; this guards against any other sender.
            error = TokenOutput(msg.request_id, [], finish_reason="error", error=str(exc))
            self._replies.append(EngineOutputs(outputs=[error]))
            return
        if msg.params.structured is not None:
            assert self._compiles is not None  # requests are added by the step loop only
            matcher = self.structured.prepare(request, self._compiles)
            if matcher is not None:
                self._constrain(request, matcher)
