"""The public face for Trio programs: ``open_engine`` and ``Engine`` (its
requests are ``frontend/requests/streams.py``'s ``RequestStream``, which
reaches the engine cores through a ``RequestRouter``, not through ``Engine``).

``open_engine`` collapses exception groups from inside the project into
plain exceptions (``EngineStartupError``, ``EngineDeadError``,
``RequestError``, ``ValueError``, or the caller's own exception), with
``errors.collapse``.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec
import trio

from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, InvalidRequestError, collapse, only_the_callers
from trioserve.frontend.embeddings import EncodeCalls
from trioserve.frontend.engine_ops import ProfileCalls, ScaleCalls
from trioserve.frontend.engines.group import EngineGroup
from trioserve.frontend.engines.supervisor import Health
from trioserve.frontend.lora_calls import LoraCalls
from trioserve.frontend.model_dir import load_text
from trioserve.frontend.requests.outputs import RequestOutput
from trioserve.frontend.requests.parallel_sampling import check_batch, check_n
from trioserve.frontend.requests.router import RequestObserver, RequestRouter
from trioserve.frontend.requests.streams import RequestStream
from trioserve.frontend.text.chat_template import RENDER_THREADS, ChatTemplate, TemplatedText
from trioserve.frontend.text.literal import mark_contents
from trioserve.frontend.text.prompt import Prompt
from trioserve.frontend.text.structured import CHECK_THREADS, check_constraint_compiles
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import EngineInfo, EngineStats
from trioserve.rpc import (
    CollectiveCall,
    CollectiveRpc,
    ControlCall,
    ControlReply,
    DescribeShard,
    Echo,
    Pause,
    PauseMode,
    Resume,
    Sleep,
    SleepLevel,
    WakeUp,
    WorkerResult,
)
from trioserve.sampling_params import SamplingParams
from trioserve.structured import StructuredOutput

# A call that runs on the workers (sleep, wake_up, collective_rpc) gets at least this long: past
# its timeout the workers count as hung and are killed with their engine core.
MIN_WORKER_CALL_TIMEOUT_S = 1.0
MAX_BATCH_PROMPTS = 1024  # prompts in one stream_prompts batch (a completions request's list of prompts)


@contextlib.asynccontextmanager
async def open_engine(
    model: str | None = None, *, config: EngineConfig | None = None, **options: Any
) -> AsyncIterator[Engine]:
    """Start an engine (``data_parallel_size`` engine-core processes, one by
    default, each with its workers) for the duration of the block.

    Give either ``model`` (a local Hugging Face model directory) and any other
    ``EngineConfig`` fields as keywords, or a whole ``config``. Start-up
    failures raise ``EngineStartupError``. When the block exits, normally, by
    an exception or by cancellation, every process is stopped and reaped
    before this returns.

    If an engine core (or a worker) dies while the block runs, its requests
    in flight raise ``EngineDeadError`` and it is restarted (see
    ``EngineConfig.max_restarts``); new requests go to the other engines, or
    wait for it. Once every engine is out of restarts, every request raises
    ``EngineDeadError`` and ``wait_failed()`` returns; the block itself is
    never interrupted.
    """
    if config is None:
        if model is None:
            raise ValueError("model: give a model directory (or config=EngineConfig(...))")
        config = EngineConfig(model=model, **options)
    elif model is not None or options:
        raise ValueError("config: give either config=... or model and options, not both")
    async with _open(config, EngineGroup(config)) as engine:
        yield engine


@contextlib.asynccontextmanager
async def open_attached_engine(config: EngineConfig, api_server: int, directory: str) -> AsyncIterator[Engine]:
    """As ``open_engine``, for API server ``api_server`` of several
    (``serve --api-server-count``): the engine cores are another process's
    (its children, or engine cores on other hosts that joined it), and
    ``directory`` says where each listens for API servers; this attaches to
    each (``frontend/engines/attached.py``) and starts no process."""
    async with _open(config, EngineGroup(config, attach=(api_server, directory)), f"api{api_server}") as engine:
        yield engine


@contextlib.asynccontextmanager
async def _open(config: EngineConfig, group: EngineGroup, id_prefix: str | None = None) -> AsyncIterator[Engine]:
    tokenizer, chat_template = await trio.to_thread.run_sync(load_text, config)
    own: BaseException | None = None  # what the caller's block raised
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(group.run)
            try:
                yield Engine(group, tokenizer, chat_template, id_prefix=id_prefix)
            except BaseException as exc:
                own = exc
                raise
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as exc:
        if own is not None and only_the_callers(exc, own):
            raise own from own.__cause__  # the caller's own exception (a group of theirs too) comes out as it was
        raise collapse(exc) from None


def _check_mode(mode: object) -> None:
    if mode not in ("wait", "abort"):
        raise InvalidRequestError("mode", f"must be 'wait' or 'abort' (got {mode!r})")


class Engine(EncodeCalls, LoraCalls, ProfileCalls, ScaleCalls):
    """A running engine. Get one from ``open_engine``. Its public names are
    the ones docs/embedding.md lists (a test checks they agree)."""

    def __init__(
        self,
        group: EngineGroup,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None = None,
        *,
        id_prefix: str | None = None,
    ) -> None:
        """``id_prefix``: put before the request ids, unique among the API
        servers of one engine (its own random part follows)."""
        self._group = group
        self._tokenizer = tokenizer
        self._chat_template = chat_template  # the model's own, or None
        self._router = RequestRouter(group, tokenizer)
        self._render_threads = trio.CapacityLimiter(RENDER_THREADS)
        self._check_threads = trio.CapacityLimiter(CHECK_THREADS)
        self._ids = itertools.count()
        own = secrets.token_hex(3)
        self._id_prefix = own if id_prefix is None else f"{id_prefix}-{own}"
        self._init_loras()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (``encode``, ``decode``), from its ``tokenizer.json``."""
        return self._tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template (``render_chat`` renders with it), or None when it has none."""
        return self._chat_template

    def add_request_observer(self, observer: RequestObserver) -> None:
        """Call ``observer`` (synchronously; it must not block) with each
        request's ``RequestMetrics`` when it ends, however it ends."""
        self._router.observers.append(observer)

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        special_tokens_in_content: bool = False,
        tools: Sequence[Mapping[str, object]] | None = None,
        documents: Sequence[Mapping[str, object]] | None = None,
        variables: Mapping[str, object] | None = None,
    ) -> TemplatedText:
        """The prompt for chat ``messages`` (mappings with ``role`` and
        ``content``), rendered with the model's chat template in a worker
        thread (at most ``RENDER_THREADS`` per engine at once); give it to
        ``stream`` as the prompt. Raises ``InvalidRequestError`` naming
        ``messages`` when the model has no template, or it refuses them,
        fails on them or takes longer than ``RENDER_TIMEOUT_S``
        (``frontend/text/chat_template.py``), and ``PromptTooLongError`` when its
        text cannot fit the context. If cancelled, the thread's result is
        dropped when it ends (by that timeout at the latest).

        The text of a special token in a message's content (``<|im_end|>``)
        stays text (``frontend/text/literal.py``): a user cannot end their
        turn and write another role's. ``special_tokens_in_content`` lets it
        become the token, as transformers' ``apply_chat_template`` does.
        ``tools`` (OpenAI's: ``{"type": "function", "function": {...}}``),
        ``documents``, ``variables`` (``enable_thinking``) and
        ``continue_final_message``: see ``ChatTemplate.render``."""
        template = self.chat_template
        if template is None:
            raise InvalidRequestError(
                "messages", "this model has no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        specials = () if special_tokens_in_content else self._tokenizer.special_texts

        def render() -> TemplatedText:
            text = template.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                max_chars=self._router.prompts.max_chars,
                tools=tools,
                documents=documents,
                variables=variables,
            )
            return mark_contents(text, messages, specials) if specials else text

        return await trio.to_thread.run_sync(render, abandon_on_cancel=True, limiter=self._render_threads)

    async def check_structured(self, constraint: StructuredOutput) -> None:
        """Raise ``InvalidRequestError`` naming ``structured`` if a request's
        constraint (``SamplingParams.structured``) cannot compile: an invalid
        schema, regex or grammar, a keyword the engine cannot enforce, or one
        that takes longer than ``CHECK_TIMEOUT_S`` to check (in a worker
        thread). A request whose constraint was not checked is checked by
        the engine core, where the same problem ends it with ``RequestError``.
        If cancelled, the thread's result is dropped when it ends."""
        await check_constraint_compiles(constraint, self._check_threads)

    @property
    def config(self) -> EngineConfig:
        """The ``EngineConfig`` it runs with."""
        return self._group.config

    @property
    def info(self) -> EngineInfo:
        """What the engine core reported when it became ready (after a
        restart, the new one's: its process ids change)."""
        return self._group.info

    @property
    def health(self) -> Health:
        """``starting``, ``ready``, ``stalled`` (ready, but a hang is suspected:
        see ``EngineConfig.heartbeat_timeout_s``), ``paused`` or ``sleeping``
        (up, but holding new requests: ``pause()``, ``sleep()``),
        ``restarting`` (the engine core died, or was declared hung and killed,
        and is being restarted), ``failed`` (out of restarts: for good) or
        ``stopped``."""
        return self._group.health

    @property
    def num_restarts(self) -> int:
        """How many times the engine core has been restarted (with several
        engines: all of them together)."""
        return self._group.num_restarts

    @property
    def num_restarts_by_engine(self) -> list[int]:
        """How many times each engine core has been restarted, by engine index."""
        return [s.num_restarts for s in self._group.supervisors]

    async def wait_failed(self) -> EngineDeadError:
        """Wait until the engine has failed for good (it died more often than
        its restart budget allows); returns the error every request now raises.
        Raises ``EngineDeadError`` once it is stopped (it will never fail)."""
        return await self._group.wait_failed()

    async def wait_ready(self) -> None:
        """Wait until the engine is up: at once, unless it is starting or
        restarting (``ready``, and also ``paused``, ``sleeping`` or
        ``stalled``: up, though not generating for now). Raises
        ``EngineDeadError`` if it failed or stopped instead."""
        await self._group.wait_health("ready", "paused", "sleeping", "stalled", "failed", "stopped")
        if self.health in ("failed", "stopped"):
            await self._group.ready_client()  # raises the reason

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        client_id: str = "",
        engine_index: int | None = None,
    ) -> RequestStream:
        """A request whose outputs arrive as they are produced.

        Use as ``async with engine.stream(prompt, params) as stream: async for
        out in stream: ...``. ``prompt`` is text or a list of token ids.
        Invalid input raises ``InvalidRequestError`` (a ``ValueError``)
        naming the field, before anything is sent: here, or, for a text long
        enough to be tokenized in a thread (``frontend/text/prompt.py``), when the
        block is entered. A prompt that does not fit the context raises
        ``PromptTooLongError`` (one of those). Waiting requests of different
        ``client_id``s are admitted in turn. With several engine cores the
        request goes to the least loaded, or to ``engine_index``'s when given
        (an external load balancer's choice). Leaving the block before the
        request finished, or being cancelled, aborts it in the engine and
        frees its KV blocks.
        """
        params = self._check_request(SamplingParams() if params is None else params, client_id, engine_index)
        token_ids = self._router.token_ids_now(prompt)
        return RequestStream(
            self._router, self._new_id(), prompt, token_ids, params, client_id=client_id, engine_index=engine_index
        )

    def stream_n(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        n: int = 1,
        *,
        client_id: str = "",
        engine_index: int | None = None,
    ) -> RequestStream:
        """``n`` samples of one prompt, streamed together: a parent request
        fanned out into ``n`` requests in the engine (sample ``i`` named
        ``{request_id}-{i}``), in one ``RequestStream``. Each ``RequestOutput``
        says which sample it belongs to (``index``). With ``params.seed``,
        sample ``i`` uses ``seed + i``. Checks as ``stream`` (and ``n``, in
        [1, 128]); leaving the block early, or being cancelled, aborts every
        sample still running. The samples go to one engine, so ``n`` beyond
        what an engine takes at once (``max_num_seqs + max_waiting_requests``)
        is refused too: no retry could ever run it.
        """
        return self.stream_prompts([prompt], params, n, client_id=client_id, engine_index=engine_index)

    def stream_prompts(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | None = None,
        n: int = 1,
        *,
        client_id: str = "",
        engine_index: int | None = None,
    ) -> RequestStream:
        """A batch: ``n`` samples of each of ``prompts`` (1 to
        ``MAX_BATCH_PROMPTS``), streamed together as ``stream_n`` streams one
        prompt's; sample ``j`` of prompt ``p`` has ``index`` ``p * n + j``
        (named ``{request_id}-{index}``, with ``seed + j`` when seeded), and
        ``num_prompt_tokens`` counts every prompt. Checks as ``stream_n``,
        each prompt as ``stream`` does; all the samples go to one engine, so
        more than it takes at once is refused (``n`` names it)."""
        params = self._check_request(SamplingParams() if params is None else params, client_id, engine_index)
        n = check_n(n)
        if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not 1 <= len(prompts) <= MAX_BATCH_PROMPTS:
            raise InvalidRequestError("prompt", f"a batch holds 1 to {MAX_BATCH_PROMPTS} prompts")
        check_batch(len(prompts), n, self.config.max_num_seqs + self.config.max_waiting_requests)
        checked = [(prompt, self._router.token_ids_now(prompt)) for prompt in prompts]
        (first, first_ids), *more = checked
        return RequestStream(
            self._router,
            self._new_id(),
            first,
            first_ids,
            params,
            client_id=client_id,
            engine_index=engine_index,
            n=n,
            more_prompts=more,
        )

    def _check_request(self, params: object, client_id: object, engine_index: object = None) -> SamplingParams:
        """The params, checked with the rest of a request and made ready for
        the engine (``RequestRouter.prepare_params``)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be a SamplingParams (got {type(params).__name__})")
        if not isinstance(client_id, str):
            raise InvalidRequestError("client_id", f"must be a string (got {type(client_id).__name__})")
        num_engines = self.config.data_parallel_size
        if engine_index is not None and (
            not isinstance(engine_index, int) or isinstance(engine_index, bool) or not 0 <= engine_index < num_engines
        ):
            raise InvalidRequestError("engine_index", f"must be an engine index in [0, {num_engines}) or None")
        return self._router.prepare_params(params)

    def _new_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, engine_index: int | None = None
    ) -> RequestOutput:
        """Run a request to the end: one output holding all its text and tokens.

        If cancelled, the request is aborted in the engine.
        """
        result: RequestOutput | None = None
        async with self.stream(prompt, params, engine_index=engine_index) as stream:
            async for output in stream:
                if result is None:
                    result = output
                else:
                    result.merge(output)
        assert result is not None  # a stream ends only after a finished output
        return result

    async def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids the engine would run for ``prompt`` (a text, such as
        one ``render_chat`` made, or token ids), checked as a request's
        prompt is: ``InvalidRequestError`` or ``PromptTooLongError`` naming
        ``prompt``. A long text is tokenized in a worker thread."""
        return await self._router.check_prompt(prompt)

    async def stats(self) -> EngineStats:
        """The engine cores' counters (running and waiting requests, free KV
        blocks...): with several engines, the totals, and each engine's own
        in ``engines``; every worker's share of the model and its memory in
        ``workers`` (``ShardInfo``, by engine then rank). While no engine is
        ready, waits like a request."""
        return await self._group.stats()

    # --- control calls (rpc.py; every engine core of the group) ----------------

    async def pause(self, *, mode: PauseMode = "wait", timeout_s: float | None = None) -> None:
        """Pause generation: requests made from now on wait (``health`` is
        ``paused``) until ``resume()``; those already in the engine finish
        (``mode="wait"``) or end at once with finish reason ``abort``
        (``"abort"``). Returns once none runs. Raises ``ControlCallError`` if
        they have not ended within ``timeout_s`` (default
        ``config.control_timeout_s``): the engine stays paused. If cancelled,
        the pause may still take effect."""
        _check_mode(mode)
        await self._control(Pause(mode=mode), timeout_s)

    async def resume(self, *, timeout_s: float | None = None) -> None:
        """Generate again after ``pause()``: the requests that waited start."""
        await self._control(Resume(), timeout_s)

    async def sleep(self, level: SleepLevel = 1, *, mode: PauseMode = "wait", timeout_s: float | None = None) -> None:
        """Pause (as ``pause(mode=...)``), then free the KV cache (level 1)
        or the KV cache and the weights (level 2) on every worker, giving the
        memory back to the machine. ``health`` is ``sleeping``. Requests made
        while asleep wait for ``wake_up()``, or fail at once with
        ``RequestError`` when ``config.while_asleep == "fail"``."""
        _check_mode(mode)
        if type(level) is not int or level not in (1, 2):  # not True, not 1.0
            raise InvalidRequestError("level", f"must be 1 or 2 (got {level!r})")
        await self._control(Sleep(level=level, mode=mode), timeout_s, on_workers=True)

    async def wake_up(self, *, timeout_s: float | None = None) -> None:
        """Restore what ``sleep()`` freed (weights reloaded from the model
        directory, a zeroed KV cache) and generate again, unless paused."""
        await self._control(WakeUp(), timeout_s, on_workers=True)

    async def collective_rpc(self, call: CollectiveCall, *, timeout_s: float | None = None) -> list[WorkerResult]:
        """Run ``call`` (``DescribeShard`` or ``Echo``) on every worker of
        every engine core, between two steps; each rank's result, by engine
        index then rank. A worker that raises gives ``ControlCallError``
        naming its rank; the engine serves on. Workers that do not answer
        within ``timeout_s`` are hung: their engine core dies and restarts."""
        if not isinstance(call, DescribeShard | Echo):
            raise InvalidRequestError("call", f"must be DescribeShard or Echo (got {type(call).__name__})")
        try:  # its fields as the engine core will decode them: one it cannot decode is dropped there
            msgspec.convert(msgspec.to_builtins(call), type(call))
        except msgspec.ValidationError as exc:
            raise InvalidRequestError("call", f"{type(call).__name__}: {exc}") from None
        replies = await self._control(CollectiveRpc(call=call), timeout_s, on_workers=True)
        return [result for reply in replies for result in reply.results]

    async def _control(
        self, call: ControlCall, timeout_s: float | None, on_workers: bool = False
    ) -> list[ControlReply]:
        """``on_workers``: the call runs on the workers, and those that miss
        ``timeout_s`` are killed as hung, so one given here is at least
        ``MIN_WORKER_CALL_TIMEOUT_S`` (a tiny one would kill a healthy engine
        core, and every request on it). None: ``config.control_timeout_s``."""
        if timeout_s is None:
            return await self._group.control(call, self.config.control_timeout_s)
        if isinstance(timeout_s, bool) or not (isinstance(timeout_s, int | float) and 0 < timeout_s < float("inf")):
            raise InvalidRequestError("timeout_s", f"must be a positive number of seconds (got {timeout_s!r})")
        if on_workers and timeout_s < MIN_WORKER_CALL_TIMEOUT_S:
            raise InvalidRequestError(
                "timeout_s",
                f"must be at least {MIN_WORKER_CALL_TIMEOUT_S:g} s for {type(call).__name__}, which runs on the "
                f"workers: one that misses it is killed as hung (got {timeout_s!r})",
            )
        return await self._group.control(call, float(timeout_s))

    @property
    def engine_infos(self) -> list[EngineInfo]:
        """Each engine core's ``EngineInfo``, by engine index (its latest start's)."""
        return [s.info for s in self._group.supervisors if s.info is not None]

    @property
    def engine_healths(self) -> list[Health]:
        """Each engine core's health, by engine index."""
        return self._group.engine_healths

    async def reset_prefix_cache(self) -> int:
        """Make the engine forget every cached prefix (after new weights, say,
        or to measure without it); requests running keep their blocks.
        Returns how many cached blocks were forgotten (by every engine). While
        no engine is ready, waits like a request (an engine that restarts
        starts with an empty cache)."""
        return await self._group.reset_prefix_cache()

    def num_requests_in_flight(self) -> int:
        """Requests the front-end holds state for (submitted and not yet over; waiting to be resumed too)."""
        return self._group.num_requests_in_flight()
