"""Embedding requests: how a prompt's hidden states become one vector.

An embedding request runs its prompt through the model like a generation
request's prefill, and ends when the prompt is computed: instead of sampling
a token, the worker pools the last layer's hidden states of the prompt into
one vector (``PoolingParams``), which the engine core sends back as float32
bytes. It travels inside ``SamplingParams.pooling`` (``Engine.encode`` sets
it: a generation request never has one).

- ``"last"``: the last prompt token's hidden state (decoder-only embedding
  models: Qwen3-Embedding, e5-mistral). Its prompt may be found in the
  prefix cache, as a generation request's: the last token is always computed.
- ``"mean"``: the mean over every prompt token; ``"cls"``: the first token's.
  Both need the hidden states of tokens a prefix-cache hit would skip, so such
  a request computes its whole prompt.

An encoder of BERT's family (``whole``) attends both ways, so its prompt is
computed in one step (never chunked, never from the prefix cache), in a
padded batch of whole prompts, without the paged KV cache.

Then, in this order: the first ``dimensions`` components are kept (Matryoshka
models are trained so that a prefix of the vector is an embedding too), and,
with ``normalize``, the vector is scaled to unit length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from trioserve.checks import check_bool, check_int
from trioserve.config import EngineConfig
from trioserve.errors import InvalidRequestError

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean", "cls")
MAX_DIMENSIONS = 1 << 16  # components of a vector: more than any model's hidden size


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """How an embedding request's hidden states become its vector (see the
    module's docstring). ``dimensions``: None keeps them all; more than the
    model's hidden size is refused by the engine, which knows it."""

    type: PoolingType = "last"
    normalize: bool = True
    dimensions: int | None = None
    whole: bool = False  # an encoder's prompt: computed in one step, attending both ways

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise InvalidRequestError("pooling.type", f"must be one of {', '.join(POOLING_TYPES)} (got {self.type!r})")
        check_bool("pooling.normalize", self.normalize)
        check_bool("pooling.whole", self.whole)
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, 1, MAX_DIMENSIONS)

    @property
    def reads_every_token(self) -> bool:
        """Whether it needs the hidden states of tokens a prefix-cache hit skips."""
        return self.type != "last" or self.whole


FAKE_HIDDEN_SIZE = 32  # the fake runner's vectors


def fake_vector(prompt: list[int], pooling: PoolingParams) -> list[float]:
    """The fake runner's vector for ``prompt``: a made-up hidden state per
    token (a function of the token alone), pooled as ``pooling`` says."""
    rows = {"last": prompt[-1:], "cls": prompt[:1], "mean": prompt}[pooling.type]
    vector = [sum(((t * 31 + i * 7) % 17 - 8) / 8 for t in rows) / len(rows) for i in range(FAKE_HIDDEN_SIZE)]
    vector = vector[: pooling.dimensions]
    if pooling.normalize:
        norm = sum(x * x for x in vector) ** 0.5 or 1.0
        vector = [x / norm for x in vector]
    return vector


# --- a model's own pooling ----------------------------------------------------

_ST_MODULES = "modules.json"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# Bidirectional encoders (config.json's model_type): their prompts are computed whole, without the KV cache.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "camembert"})


@dataclass(frozen=True)
class ModelPooling:
    """What a model directory says of embeddings: whether it is an embedding
    model, and its pooling and normalisation (sentence-transformers' files)."""

    embeds: bool
    type: PoolingType = "last"
    normalize: bool = True
    encoder: bool = False  # a bidirectional encoder (BERT's family): each prompt whole, in one step


def model_pooling(model_dir: str | Path) -> ModelPooling:
    """Read ``modules.json`` and its Pooling module's ``config.json`` (as
    sentence-transformers saves a model). A model with a Pooling module
    embeds, pooled by its mode and normalised when a Normalize module
    follows; else a model whose ``config.json`` names architectures, none of
    them generative (``BertModel``), embeds, by its last token, normalised.
    ``ValueError`` naming the file when one is not what it should be."""
    directory = Path(model_dir)
    config = _read(directory / "config.json", {})
    encoder = isinstance(config, dict) and config.get("model_type") in ENCODER_MODEL_TYPES
    modules = _read(directory / _ST_MODULES, [])
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{directory / _ST_MODULES}: must be a list of modules")
    kinds = [str(m.get("type", "")) for m in modules]
    if _ST_POOLING in kinds:
        path = directory / str(modules[kinds.index(_ST_POOLING)].get("path", "")) / "config.json"
        pooling = _read(path, {})
        modes = [mode for key, mode in _ST_MODES.items() if isinstance(pooling, dict) and pooling.get(key) is True]
        if len(modes) != 1:
            raise ValueError(f"{path}: one of {', '.join(_ST_MODES)} must be true (the only poolings served)")
        return ModelPooling(True, modes[0], _ST_NORMALIZE in kinds, encoder)
    architectures = (config.get("architectures") if isinstance(config, dict) else None) or []
    embeds = bool(architectures) and not any(str(a).endswith(_GENERATIVE) for a in architectures)
    return ModelPooling(embeds, "cls" if encoder else "last", encoder=encoder)


def _read(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None


def engine_pooling(config: EngineConfig) -> ModelPooling | None:
    """How an engine with ``config`` pools, or None when it generates text:
    its ``task``, the model's own files (``model_pooling``), and the config's
    ``pooling_type`` and ``normalize`` over what those say."""
    if config.task == "generate":
        return None
    own = model_pooling(config.model)
    if config.task == "auto" and not own.embeds:
        return None
    normalize = own.normalize if config.normalize is None else config.normalize
    return ModelPooling(True, config.pooling_type or own.type, normalize, own.encoder)


def step_budget(config: EngineConfig, max_model_len: int) -> int:
    """The tokens a step may compute: ``max_num_batched_tokens``, raised to
    ``max_model_len`` for an encoder, whose prompts are computed whole (so
    that the longest still fits a step)."""
    pooling = engine_pooling(config)
    if pooling is not None and pooling.encoder:
        return max(config.max_num_batched_tokens, max_model_len)
    return config.max_num_batched_tokens
