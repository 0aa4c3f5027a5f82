"""Every message that crosses a process boundary, as ``msgspec.Struct``s.

Messages are encoded as msgpack and decoded with their type (a tagged union
per channel), so nothing that can run code ever crosses a boundary. Per-step
traffic carries only changes: new requests, new tokens, new block ids.

Channels:
- front-end <-> engine core handshake (ZMQ ROUTER/DEALER): ``Hello``,
  ``HandshakeInit``, ``Ready`` or ``StartupFailed``.
- front-end -> engine core (ZMQ ROUTER -> DEALER): ``EngineRequest``.
- engine core -> front-end (ZMQ PUSH -> PULL): ``EngineResponse``.
- engine core <-> worker (length-prefixed frames on a socketpair):
  ``ToWorker`` and ``FromWorker``.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from trioserve.config import EngineConfig

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens for one request. Invalid values raise ``ValueError``
    naming the field, at construction.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` turn
    those filters off. With ``seed`` set, the tokens depend only on the seed,
    the prompt and the model: not on what else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token

    def __post_init__(self) -> None:
        def bad(name: str, message: str) -> ValueError:
            return ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive integer")
        if not self.temperature >= 0:  # also rejects NaN
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class EngineInfo(msgspec.Struct, frozen=True):
    """What the engine learned at start-up."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    engine_pid: int
    worker_pids: list[int]


class EngineStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start
    num_steps: int  # since start


class SampleLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probability of the sampled token and of the top alternatives."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


# --- handshake -------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    engine_index: int
    pid: int


class HandshakeInit(msgspec.Struct, tag=True):
    config: EngineConfig
    input_address: str
    output_address: str


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True):
    """The engine core could not start: the stage, what went wrong, and the
    process that failed (the engine core itself or one of its workers) with
    its exit status when it exited (negative: the signal)."""

    stage: str
    message: str
    process: str = ""
    exit_code: int | None = None


HandshakeMessage = Union[Hello, HandshakeInit, Ready, StartupFailed]


# --- front-end -> engine core ----------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag=True):
    call_id: int


EngineRequest = Union[AddRequest, AbortRequests, GetStats]


# --- engine core -> front-end ----------------------------------------------


class TokenOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[SampleLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]


class StatsReply(msgspec.Struct, tag=True):
    call_id: int
    stats: EngineStats


class EngineDead(msgspec.Struct, tag=True):
    """Sent once, on the way down, when the engine core fails."""

    reason: str


EngineResponse = Union[EngineOutputs, StatsReply, EngineDead]


# --- engine core <-> worker ------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt, plus every output token so far when resumed
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int  # the first this many of token_ids are the prompt (penalties count the rest)


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the workers already hold: only what changed since its last step.
    No tokens: the workers append each token they sample to the request
    themselves (so a step can be sent before the previous one's tokens have
    come back to the engine core)."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, tag=True):
    """One step's work. For each scheduled request the worker computes tokens
    ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[id])`` of
    its token list, and samples one token when that range reaches the end of
    the list, which it then appends to the list. ``finished_req_ids``
    (finished, aborted or preempted since the last step) tell workers which
    per-request state to drop: they drop it before running the step.
    """

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]


class WorkerInit(msgspec.Struct, tag=True):
    config: EngineConfig
    rank: int
    world_size: int


class WorkerLoaded(msgspec.Struct, tag=True):
    """The model is loaded; how many KV blocks this worker could hold."""

    max_num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


class InitKVCache(msgspec.Struct, tag=True):
    num_blocks: int


class KVCacheReady(msgspec.Struct, tag=True):
    pass


class RunnerOutput(msgspec.Struct, tag=True):
    """One sampled token for each request whose scheduled range reached the end."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None = None


class WorkerFailed(msgspec.Struct, tag=True):
    """A worker's last word: what went wrong, before it exits non-zero."""

    stage: str
    message: str


ToWorker = Union[WorkerInit, InitKVCache, SchedulerOutput]
FromWorker = Union[WorkerLoaded, KVCacheReady, RunnerOutput, WorkerFailed]
