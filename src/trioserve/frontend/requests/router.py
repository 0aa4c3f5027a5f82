"""What a request stream needs of its engine, kept off the public ``Engine``.

``RequestRouter`` checks a stream's prompt against the engine's tokenizer
and context, builds the state of each of its requests, and submits them to
one engine core of the group (the least loaded ready one, or the one asked
for): all of them or none. It tells the request observers when each
request ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from trioserve.config import EngineConfig
from trioserve.errors import InvalidRequestError
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.frontend.engines.group import EngineGroup
from trioserve.frontend.requests.held import HeldEntries, request_entries
from trioserve.frontend.requests.outputs import RequestMetrics
from trioserve.frontend.requests.state import RequestState
from trioserve.frontend.text.prompt import Prompt, PromptChecker
from trioserve.frontend.text.sampling import prepare_params
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.pooling import engine_pooling
from trioserve.sampling_params import SamplingParams

TASK_REFUSALS = {  # by whether the engine embeds
    True: "this model serves embeddings (Engine.encode, /v1/embeddings), not text generation",
    False: "this model serves text generation, not embeddings (serve an embedding model, or give --task embed)",
}
log = logging.getLogger("trioserve.api")  # the public face's: where its users look for it
RequestObserver = Callable[[RequestMetrics], None]


class RequestRouter:
    """Between an engine's request streams and its group of engine cores (see the module docstring)."""

    def __init__(self, group: EngineGroup, tokenizer: Tokenizer) -> None:
        self._group = group
        self.tokenizer = tokenizer
        self.observers: list[RequestObserver] = []  # told each request's metrics when it ends
        config = group.config
        self.held = HeldEntries(config.max_request_entries, config.max_held_entries)  # counted by the streams
        self.pooling = engine_pooling(config)  # None: the engine generates text; else how it embeds
        self.prompts = PromptChecker(tokenizer, group.info, output_room=0 if self.pooling else 1)

    @property
    def config(self) -> EngineConfig:
        return self._group.config

    def token_ids_now(self, prompt: Prompt) -> list[int] | None:
        """The prompt's token ids, checked here (``InvalidRequestError``
        otherwise); None for a text long enough to be tokenized in a thread
        (``check_prompt``, when its stream is entered)."""
        return None if self.prompts.needs_thread(prompt) else self.prompts.check(prompt)

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the model's vocabulary and the
        server's ``max_logprobs``, with their ``bad_words`` tokenized
        (``frontend/text/sampling.py``)."""
        max_logprobs = self._group.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > max_logprobs:
                raise InvalidRequestError(name, f"at most {max_logprobs} on this server (--max-logprobs; got {wanted})")
        if params.lora is not None and not self._group.config.enable_lora:
            raise InvalidRequestError("lora", "this engine serves no LoRA adapters (started without --enable-lora)")
        if (params.pooling is not None) != (self.pooling is not None):
            raise InvalidRequestError("task", TASK_REFUSALS[self.pooling is not None])
        if params.pooling is not None and self.pooling is not None and params.pooling.whole != self.pooling.encoder:
            whole = msgspec.structs.replace(params.pooling, whole=self.pooling.encoder)  # as the model computes
            params = msgspec.structs.replace(params, pooling=whole)
        hidden = self._group.info.model.hidden_size
        if params.pooling is not None and hidden and (params.pooling.dimensions or 0) > hidden:
            raise InvalidRequestError(
                "dimensions", f"at most the model's {hidden} components (got {params.pooling.dimensions})"
            )
        return prepare_params(params, self.tokenizer, self.prompts.vocab_size)

    def entries(self, params: SamplingParams, n: int, num_prompt_tokens: int) -> int:
        """The most entries a request can make this front-end hold (``held.py``)."""
        return request_entries(params, n, num_prompt_tokens, self._group.info.max_model_len)

    async def check_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked (``InvalidRequestError`` otherwise),
        a long text tokenized in a worker thread. If cancelled, the thread's
        result is dropped when it ends."""
        return await self.prompts.check_async(prompt)

    def new_state(
        self, request_id: str, token_ids: list[int], params: SamplingParams, client_id: str, index: int = 0
    ) -> RequestState:
        """The state of one request of a stream (sample ``index``), its end told to the observers."""
        return RequestState(
            request_id,
            token_ids,
            params,
            self.tokenizer,
            eos_token_ids=self._group.info.eos_token_ids,
            client_id=client_id,
            index=index,
            on_end=self._request_ended if self.observers else None,
        )

    async def submit(self, states: Sequence[RequestState], engine_index: int | None = None) -> EngineCoreClient:
        """Submit checked requests to one engine core (``engine_index``'s when
        given, else the least loaded ready one; while none is ready, wait at
        most ``restart_wait_s``): all of them, or, if one fails or this is
        cancelled, none. The client they went to."""
        client, wave = await self._group.route(engine_index)
        try:
            for state in states:
                state.engine_index, state.target = client.engine_index, engine_index
                await client.submit(state, wave)
        except BaseException:
            for state in states:
                state.abort()  # in the engine core, or (its engine core died meanwhile) not resumed
                state.forget()  # refused, not ended: the request observers (metrics) hear nothing
            raise
        return client

    def _request_ended(self, metrics: RequestMetrics) -> None:
        for observer in self.observers:
            try:
                observer(metrics)
            except Exception:  # an observer's bug must not fail a request
                log.exception("a request observer failed")
