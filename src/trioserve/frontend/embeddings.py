"""``Engine.encode`` and ``Engine.encode_batch``: embeddings, on an engine
that serves an embedding model (``trioserve.pooling``).

An embedding request is a request like any other in the engine (admitted,
batched, preempted and aborted as generation requests are) whose prompt is
its whole work: it ends when the prompt is computed, with its vector. The
prompt is checked as a generation prompt is, but may fill the whole
context (``max_model_len`` tokens): nothing is generated after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio

from trioserve.errors import InvalidRequestError, RequestError
from trioserve.frontend.requests.router import TASK_REFUSALS, RequestRouter
from trioserve.frontend.requests.streams import RequestStream
from trioserve.frontend.text.prompt import Prompt
from trioserve.pooling import PoolingParams
from trioserve.sampling_params import SamplingParams

MAX_BATCH_INPUTS = 2048  # prompts in one encode_batch
MAX_TEXT_SIZE = 1 << 62  # a text to be tokenized when submitted, ordered as longer than any checked prompt


@dataclass
class EmbeddingOutput:
    """One prompt's vector: ``embedding`` (float32 values), pooled as the
    model says (or the engine's config), cut to ``dimensions`` when asked and
    then normalised when asked. ``num_cached_tokens``: its prompt tokens
    found in the prefix cache (None without prefix caching)."""

    request_id: str
    embedding: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int | None = None


class EncodeCalls:
    """``Engine``'s embedding calls (``Engine`` supplies ``stream`` and its router)."""

    _router: RequestRouter

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        client_id: str = "",
        engine_index: int | None = None,
    ) -> RequestStream:
        raise NotImplementedError

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the engine serves: ``("generate",)`` (text: ``stream`` and the
        calls on it) or ``("embed",)`` (``encode``, ``encode_batch``)."""
        return ("generate",) if self._router.pooling is None else ("embed",)

    async def encode(
        self,
        prompt: Prompt,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        client_id: str = "",
        engine_index: int | None = None,
    ) -> EmbeddingOutput:
        """The vector of ``prompt`` (text or token ids). ``dimensions`` keeps
        its first components (Matryoshka models), at most the model's hidden
        size; ``normalize`` overrides the model's own choice. Checks and
        routing as ``Engine.stream``; ``InvalidRequestError`` naming ``task``
        on an engine that generates text. If cancelled, the request is
        aborted in the engine."""
        params = self._embedding_params(dimensions, normalize)
        return await self._encode(prompt, params, client_id, engine_index)

    async def _encode(
        self,
        prompt: Prompt,
        params: SamplingParams,
        client_id: str,
        engine_index: int | None,
        submitted: trio.Event | None = None,
    ) -> EmbeddingOutput:
        """``encode`` with its params made; ``submitted`` is set once the
        request is in the engine."""
        async with self.stream(prompt, params, client_id=client_id, engine_index=engine_index) as stream:
            if submitted is not None:
                submitted.set()
            async for output in stream:
                if output.embedding is not None:
                    return EmbeddingOutput(
                        stream.request_id, output.embedding, output.num_prompt_tokens, output.num_cached_tokens
                    )
                if output.finished:
                    raise RequestError(f"request {stream.request_id}: ended ({output.finish_reason}) with no vector")
        raise RequestError(f"request {stream.request_id}: ended with no vector")

    async def encode_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        client_id: str = "",
    ) -> list[EmbeddingOutput]:
        """The vectors of ``prompts`` (1 to ``MAX_BATCH_INPUTS``), in order:
        submitted together, so that the engine batches them, with at most
        ``max_num_seqs + max_waiting_requests`` of them in the engine at once.
        Every prompt is checked before any is submitted; the first failure
        aborts the others. They are submitted longest first (a text too long
        to check here counts as longest), so that the engine's steps batch
        prompts of like lengths (an encoder pads each batch to its longest)."""
        if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not 1 <= len(prompts) <= MAX_BATCH_INPUTS:
            raise InvalidRequestError("input", f"a batch holds 1 to {MAX_BATCH_INPUTS} inputs")
        params = self._embedding_params(dimensions, normalize)
        self._router.prepare_params(params)  # its fields checked once, before any request runs
        # Every prompt checked (and tokenized) once, before any runs; a long text is checked when submitted.
        checked = [self._router.token_ids_now(prompt) for prompt in prompts]
        prompts = [prompt if ids is None else ids for prompt, ids in zip(prompts, checked, strict=True)]
        config = self._router.config
        limiter = trio.CapacityLimiter(config.max_num_seqs + config.max_waiting_requests)
        results: dict[int, EmbeddingOutput] = {}
        failed: list[Exception] = []  # the first failure, raised as it is (not in a group)

        async def one(index: int, submitted: trio.Event, scope: trio.CancelScope) -> None:
            try:
                results[index] = await self._encode(prompts[index], params, client_id, None, submitted)
            except Exception as exc:
                failed.append(exc)
                scope.cancel()  # the others are aborted
            finally:
                submitted.set()
                limiter.release_on_behalf_of(index)

        sizes = [MAX_TEXT_SIZE if ids is None else len(ids) for ids in checked]
        async with trio.open_nursery() as nursery:
            for index in sorted(range(len(prompts)), key=lambda i: -sizes[i]):
                await limiter.acquire_on_behalf_of(index)
                submitted = trio.Event()
                nursery.start_soon(one, index, submitted, nursery.cancel_scope)
                await submitted.wait()  # in the engine (or ended) before the next is submitted
        if failed:
            raise failed[0]
        return [results[index] for index in range(len(prompts))]

    def _embedding_params(self, dimensions: int | None, normalize: bool | None) -> SamplingParams:
        """An embedding request's params on this engine (``InvalidRequestError``
        naming ``task`` where it generates text, or the field at fault)."""
        pooling = self._router.pooling
        if pooling is None:
            raise InvalidRequestError("task", TASK_REFUSALS[False])
        chosen = pooling.normalize if normalize is None else normalize
        pooled = PoolingParams(type=pooling.type, normalize=chosen, dimensions=dimensions, whole=pooling.encoder)
        return SamplingParams(max_tokens=1, pooling=pooled)
