"""``POST /v1/embeddings``, as OpenAI's (and vLLM's): one vector per input,
from an engine that serves an embedding model (``Engine.encode_batch``).

``input`` is a string, a list of strings, a list of token ids, or a list of
lists of token ids (1 to ``MAX_BATCH_INPUTS`` inputs, each a prompt the
model's context holds); ``encoding_format`` is ``float`` (lists of numbers)
or ``base64`` (each vector's float32 little-endian bytes, base64-encoded);
``dimensions`` keeps the first components of each vector; vLLM's
``normalize`` overrides the model's own normalisation, and its
``truncate_prompt_tokens`` cuts each input to its first N tokens (-1: to
the longest the context takes) where a longer input would be refused.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

import msgspec
import trio

from trioserve.api import Engine
from trioserve.frontend.embeddings import MAX_BATCH_INPUTS
from trioserve.server import openai_protocol as oai

NAMES = {"prompt": "input"}  # an engine error's field, as this endpoint calls it


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]  # a string, strings, token ids, or lists of token ids (checked by ``inputs``)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, unused
    normalize: bool | None = None  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


def inputs(request: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, one prompt each; ``OpenAIError`` naming ``input``
    for none, too many, or an empty one."""
    given: Any = request.input
    one = isinstance(given, str) or (given and all(_is_id(item) for item in given))
    prompts: list[Any] = [given] if one else list(given)
    for prompt in prompts:
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(_is_id(t) for t in prompt)):
            raise oai.invalid("input", "must be a string, strings, token ids, or lists of token ids")
    if not 1 <= len(prompts) <= MAX_BATCH_INPUTS:
        raise oai.invalid("input", f"give 1 to {MAX_BATCH_INPUTS} inputs (got {len(prompts)})")
    if any(len(prompt) == 0 for prompt in prompts):
        raise oai.invalid("input", "an input is empty")
    return prompts


def _is_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


async def truncated(engine: Engine, prompts: list[str | list[int]], keep: int | None) -> list[str | list[int]]:
    """Each prompt cut to its first ``keep`` tokens (-1: the most the context
    takes); texts are tokenized in a worker thread."""
    if keep is None:
        return prompts
    longest = engine.info.max_model_len
    if keep == -1:
        keep = longest
    if not 1 <= keep <= longest:
        raise oai.invalid("truncate_prompt_tokens", f"must be -1 or in [1, {longest}] (got {keep})")
    encode = engine.tokenizer.encode
    out: list[str | list[int]] = []
    for prompt in prompts:
        ids = prompt if isinstance(prompt, list) else await trio.to_thread.run_sync(encode, prompt)
        out.append(list(ids[:keep]))
    return out


async def embeddings(engine: Engine, request: EmbeddingRequest, model_name: str, client_id: str) -> EmbeddingList:
    """Answer ``request`` (its model already checked). Raises ``OpenAIError``
    for a bad field of its own, and what ``Engine.encode_batch`` raises."""
    prompts = await truncated(engine, inputs(request), request.truncate_prompt_tokens)
    outputs = await engine.encode_batch(
        prompts, dimensions=request.dimensions, normalize=request.normalize, client_id=client_id
    )
    data = []
    for index, output in enumerate(outputs):
        vector: list[float] | str = output.embedding
        if request.encoding_format == "base64":
            packed = struct.pack(f"<{len(output.embedding)}f", *output.embedding)
            vector = base64.b64encode(packed).decode()
        data.append(EmbeddingData(index=index, embedding=vector))
    tokens = sum(output.num_prompt_tokens for output in outputs)
    return EmbeddingList(
        id=f"embd-{outputs[0].request_id}",
        created=int(time.time()),
        model=model_name,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
