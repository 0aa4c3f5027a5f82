"""trioserve: an LLM serving engine on Trio.

Public names (the docs list the same; a test checks they agree)::

    async with trioserve.open_engine(model="path/to/model") as engine:
        async with engine.stream("Hello", SamplingParams(max_tokens=32)) as stream:
            async for out in stream:
                print(out.text, end="")
"""

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
from trioserve.frontend.outputs import RequestOutput
from trioserve.frontend.streams import ParentRequestStream, RequestStream
from trioserve.messages import EngineInfo, EngineStats, SampleLogprobs, SamplingParams
from trioserve.rpc import DescribeShard, Echo, EchoReply, ShardInfo

__all__ = [
    "ControlCallError",
    "DescribeShard",
    "Echo",
    "EchoReply",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "EngineOverloadedError",
    "EngineStartupError",
    "EngineStats",
    "FakeRunnerConfig",
    "InvalidRequestError",
    "ParentRequestStream",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SampleLogprobs",
    "SamplingParams",
    "ShardInfo",
    "TrioserveError",
    "open_engine",
]
