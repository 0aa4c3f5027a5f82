"""trioserve: an LLM serving engine on Trio.

Public names (the docs list the same; a test checks they agree)::

    async with trioserve.open_engine(model="path/to/model") as engine:
        async with engine.stream("Hello", SamplingParams(max_tokens=32)) as stream:
            async for out in stream:
                print(out.text, end="")

The names are imported on first use (``__getattr__``): every child process
imports modules of this package, and the engine cores and workers need none
of the front-end that ``open_engine`` brings with it (0.2 s of CPU less per
process start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trioserve.api import Engine, open_engine
    from trioserve.config import EngineConfig, FakeRunnerConfig
    from trioserve.errors import (
        ControlCallError,
        EngineDeadError,
        EngineOverloadedError,
        EngineStartupError,
        InvalidRequestError,
        PromptTooLongError,
        RequestError,
        TrioserveError,
    )
    from trioserve.frontend.embeddings import EmbeddingOutput
    from trioserve.frontend.requests.outputs import RequestOutput
    from trioserve.frontend.requests.streams import RequestStream
    from trioserve.messages import EngineInfo, EngineStats, SampleLogprobs
    from trioserve.pooling import PoolingParams
    from trioserve.rpc import DescribeShard, Echo, EchoReply, LoraInfo, ShardInfo
    from trioserve.sampling_params import SamplingParams
    from trioserve.structured import Choice, Grammar, JsonObject, JsonSchema, Regex

__all__ = [
    "Choice",
    "ControlCallError",
    "DescribeShard",
    "Echo",
    "EchoReply",
    "EmbeddingOutput",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "EngineOverloadedError",
    "EngineStartupError",
    "EngineStats",
    "FakeRunnerConfig",
    "Grammar",
    "InvalidRequestError",
    "JsonObject",
    "JsonSchema",
    "LoraInfo",
    "PoolingParams",
    "PromptTooLongError",
    "Regex",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SampleLogprobs",
    "SamplingParams",
    "ShardInfo",
    "TrioserveError",
    "open_engine",
]

# Where each public name lives (tests/test_public_api.py checks that these
# are exactly ``__all__`` and the names imported above for type checkers).
_HOMES = {
    "trioserve.api": ("Engine", "open_engine"),
    "trioserve.config": ("EngineConfig", "FakeRunnerConfig"),
    "trioserve.errors": (
        "ControlCallError",
        "EngineDeadError",
        "EngineOverloadedError",
        "EngineStartupError",
        "InvalidRequestError",
        "PromptTooLongError",
        "RequestError",
        "TrioserveError",
    ),
    "trioserve.frontend.embeddings": ("EmbeddingOutput",),
    "trioserve.frontend.requests.outputs": ("RequestOutput",),
    "trioserve.frontend.requests.streams": ("RequestStream",),
    "trioserve.messages": ("EngineInfo", "EngineStats", "SampleLogprobs"),
    "trioserve.pooling": ("PoolingParams",),
    "trioserve.sampling_params": ("SamplingParams",),
    "trioserve.rpc": ("DescribeShard", "Echo", "EchoReply", "LoraInfo", "ShardInfo"),
    "trioserve.structured": ("Choice", "Grammar", "JsonObject", "JsonSchema", "Regex"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME_OF:
        raise AttributeError(f"module 'trioserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
