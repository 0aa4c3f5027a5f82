"""Every message that crosses a process boundary, as ``msgspec.Struct``s.

Messages are encoded as msgpack and decoded with their type (a tagged union
per channel), so nothing that can run code ever crosses a boundary. Per-step
traffic carries only changes: new requests, new tokens, new block ids.

Channels:
- front-end <-> engine core handshake (ZMQ ROUTER/DEALER): ``Hello``,
  ``HandshakeInit``, ``Heartbeat``s while the workers load, ``Ready`` or
  ``StartupFailed``.
- front-end -> engine core (ZMQ PUSH -> PULL): ``EngineRequest``.
- engine core -> front-end (ZMQ PUSH -> PULL): ``EngineResponse``.
- API server -> engine core, with several API-server processes: the
  same ``EngineRequest``s (PUSH -> the engine core's second PULL), and
  ``Attach`` on a ROUTER, answered ``Attached``, then that API server's share
  of the ``EngineResponse``s (``nurseries/engine_core/api_servers.py``).
- On TCP (an engine core on another host), the same channels, CURVE-secured,
  and ``Ping`` (front-end -> engine core) as the front-end's heartbeat.
- engine core <-> worker (length-prefixed frames on a socketpair):
  ``ToWorker`` and ``FromWorker``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from trioserve.config import EngineConfig
from trioserve.errors import StartupStage
from trioserve.rpc import ControlReply, ControlRequest, GenerationState, ShardInfo, WorkerCall, WorkerResult
from trioserve.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class ModelInfo(msgspec.Struct, frozen=True):
    """What a worker learns about its model when it loads it (``WorkerLoaded``, then ``EngineInfo``)."""

    vocab_size: int
    max_model_len: int  # the model's context length (capped by the config)
    eos_token_ids: list[int]
    hidden_size: int = 0  # of its last layer: an embedding's components (0: not known)


class EngineInfo(msgspec.Struct, frozen=True):
    """What the engine learned at start-up. ``max_model_len`` is the context
    a request may fill: the model's, capped by what the KV cache holds (so a
    request alone always fits)."""

    model: ModelInfo
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    engine_pid: int
    worker_pids: list[int]

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model.eos_token_ids


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


class EngineStats(msgspec.Struct, frozen=True):
    """The engine core's counters. ``num_free_blocks`` counts the blocks a new
    request can take: empty ones and those that only hold a cached prefix
    (``num_cached_blocks`` counts every block holding one, in use or not).
    The prefix cache's figures count first admissions only: prompt tokens
    looked up (``prefix_cache_queries``) and found (``prefix_cache_hits``)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start: running requests preempted for KV blocks
    num_steps: int  # since start
    num_fairness_preemptions: int = 0  # since start: preempted to give another client its share
    num_requests: int = 0  # since start: requests the engine took
    num_scheduled_tokens: int = 0  # since start: tokens computed by the model (prefix hits are not)
    prefix_caching: bool = False
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0  # since start
    prefix_cache_hits: int = 0
    # Steps since start by the tokens each computed, per bucket of ITERATION_TOKEN_BUCKETS (at most that bound,
    # above the one before; the last, above them all). Their tokens' sum: num_scheduled_tokens.
    iteration_tokens: list[int] = msgspec.field(default_factory=list)
    # With several engines (data parallel), the totals above are their sums and
    # this holds each engine's own figures, by engine index; empty otherwise.
    engines: list[EngineStats] = msgspec.field(default_factory=list)
    # Every worker's share and memory, by engine index then rank.
    workers: list[ShardInfo] = msgspec.field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over those looked up (0 before any)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class SampleLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probability of the sampled token and of the top alternatives."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0  # the token's rank in the distribution (1: the most likely); 0 where not computed


# --- handshake -------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    engine_index: int
    pid: int


class MayJoin(msgspec.Struct, tag=True):
    """A headless process to the head, before it starts an engine core of
    index ``engine_index``: may it join? ``previous_pid``: the pid of that
    process's previous engine core of this index (0: none), which the head
    may still hold live; the new one is to take its place."""

    engine_index: int
    previous_pid: int = 0


class JoinAnswer(msgspec.Struct, tag=True):
    """The head's answer to ``MayJoin``: ``refused`` empty, yes; else why
    not (another live engine core holds that index, or this head takes no
    engine of that index from other hosts)."""

    refused: str = ""


class DataParallelInit(msgspec.Struct, frozen=True):
    """Where an engine core stands among the data-parallel engines in
    lockstep: its rank, and the rendezvous of the collective its output
    rank's worker joins every step (an ``ipc://`` address for the fake
    runner's barrier, a file for torch.distributed's store), one per
    generation of the group."""

    rank: int
    size: int
    rendezvous: str


# In ``HandshakeInit.frontends``, for an engine core on another host: bind
# TCP where that host says (nurseries/engine_core/api_servers.py), and report the endpoints.
BIND_TCP = "tcp://"


class FrontEndsInit(msgspec.Struct, frozen=True):
    """With several API-server processes: where the engine core also listens
    for them (it binds both): a PULL for their requests, and a ROUTER on which
    each says ``Attach`` and gets its requests' outputs and every heartbeat.
    In ``HandshakeInit``, an ``ipc://`` address, or ``BIND_TCP`` for each:
    the engine core picks the TCP endpoints; in ``Ready``, the endpoints it
    bound, where the API servers connect."""

    input_address: str
    output_address: str


class HandshakeInit(msgspec.Struct, tag=True):
    config: EngineConfig
    input_address: str
    output_address: str
    data_parallel: DataParallelInit | None = None  # lockstep only
    frontends: FrontEndsInit | None = None  # several API-server processes only


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo
    frontends: FrontEndsInit | None = None  # where it listens for the API servers (when asked to)


class StartupFailed(msgspec.Struct, tag=True):
    """The engine core could not start: the stage, what went wrong, and the
    process that failed (the engine core itself or one of its workers) with
    its exit status when it exited (negative: the signal)."""

    stage: StartupStage
    message: str
    process: str = ""
    exit_code: int | None = None


class LoadReport(msgspec.Struct, tag=True):
    """The engine core's load, sent when it changes (at most every
    ``LOAD_REPORT_INTERVAL_S``) and with every heartbeat: what the front-end
    balances new requests on."""

    num_waiting: int
    num_running: int


class Heartbeat(msgspec.Struct, tag=True):
    """The engine core is alive: sent every ``heartbeat_interval_s``, during
    start-up (on the handshake socket) and after (on the output socket).
    ``stalled`` says why a hang is suspected (a worker late with its own
    heartbeat, a step running far longer than usual); empty when all is well.
    Once it serves, ``load`` and ``state`` (paused, asleep) too."""

    stalled: str = ""
    load: LoadReport | None = None
    state: GenerationState | None = None


# --- front-end -> engine core ----------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    client_id: str = ""  # waiting requests of different clients are admitted in turn
    wave: int = 0  # lockstep: the request wave the coordinator believed current (core/waves.py)
    frontend: int = -1  # the API server (by index) that sent it, or -1: the engine core's own front-end
    # A continuation (resumed after its engine died): the tokens it had generated. They count as its output
    # (penalties, min_tokens, max_tokens, stop tokens, seeded draws); prompt_token_ids stays the prompt alone.
    output_token_ids: list[int] = msgspec.field(default_factory=list)


class AbortRequests(msgspec.Struct, tag=True):
    """Forget these requests. With ``frontend`` >= 0 (from the supervising
    process of several API servers, when one dies), also every request that
    API server's process ``frontend_pid`` sent: nobody reads their outputs."""

    request_ids: list[str]
    frontend: int = -1
    frontend_pid: int = 0


class GetStats(msgspec.Struct, tag=True):
    call_id: int


class ResetPrefixCache(msgspec.Struct, tag=True):
    call_id: int  # forget every cached prefix (requests running keep their blocks)


class StartWave(msgspec.Struct, tag=True):
    """Lockstep: run request wave ``wave`` (``exclude``: the engine that already knows)."""

    wave: int
    exclude: int | None = None


class Ping(msgspec.Struct, tag=True):
    """The front-end is alive: sent every ``heartbeat_interval_s`` to an engine
    core on another host, which has no parent pipe to tell it so. With
    ``leaving``, the front-end is stopping: the engine core goes at once
    (its headless process starts another, to join the next head) rather
    than a heartbeat timeout later."""

    leaving: bool = False


EngineRequest = AddRequest | AbortRequests | GetStats | ResetPrefixCache | StartWave | Ping | ControlRequest

# On the handshake socket. A head that stops while an engine core on another host
# is still joining (before its Ready) sends it Ping(leaving=True) there.
HandshakeMessage = Hello | HandshakeInit | Heartbeat | Ready | StartupFailed | MayJoin | JoinAnswer | Ping


# --- engine core -> front-end ----------------------------------------------


class TokenOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[SampleLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    # With a request's first token, when prefix caching is on: how many of its
    # prompt tokens came from the cache.
    num_cached_tokens: int | None = None
    queued_s: float | None = None  # with its first token: how long it waited in the engine core to be scheduled
    # With its first token, when asked for: the logprobs of prompt tokens 1, 2... (the first has none).
    prompt_logprobs: list[SampleLogprobs] | None = None
    embedding: bytes | None = None  # an embedding request's vector (float32, little-endian), with its end


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]


class StatsReply(msgspec.Struct, tag=True):
    call_id: int
    stats: EngineStats


class PrefixCacheReset(msgspec.Struct, tag=True):
    """The answer to ``ResetPrefixCache``: how many cached blocks were forgotten."""

    call_id: int
    num_blocks: int


class EngineDead(msgspec.Struct, tag=True):
    """Sent once, on the way down, when the engine core fails."""

    reason: str


class WaveNotice(msgspec.Struct, tag=True):
    """Lockstep, engine core -> coordinator: wave ``wave`` is ``complete``
    (engine 0, as the engines pause), or a request arrived for a finished
    wave: start ``wave`` on the others (``start_requested``)."""

    kind: Literal["complete", "start_requested"]
    wave: int
    engine: int


class Attach(msgspec.Struct, tag=True):
    """API server -> engine core, on the API servers' ROUTER: send me my
    requests' outputs, and every heartbeat (repeated until ``Attached``).
    ``engine`` is the engine index the API server means: an engine core
    answers only its own (or -1), so an API server that reached a stale
    address never takes another engine core for the one it wanted. A new
    ``life`` of that API server (a restart, or a life ended by a watchdog)
    makes the engine core abort what the last one sent."""

    frontend: int
    engine: int = -1
    pid: int = 0  # the API server's process
    life: int = 0  # its client's life (a number new to each): a new one means the last one's requests are orphans


class Attached(msgspec.Struct, tag=True):
    """The engine core's answer to ``Attach``: its info, and whether it is
    paused or asleep (as its last reply or heartbeat said)."""

    info: EngineInfo
    state: GenerationState = GenerationState()


EngineResponse = (
    EngineOutputs
    | StatsReply
    | PrefixCacheReset
    | LoadReport
    | Heartbeat
    | WaveNotice
    | EngineDead
    | ControlReply
    | Attached
)


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
    # Lockstep: the output rank joins the data-parallel collective with this
    # engine's "has unfinished requests" (a step with no tokens is a dummy step).
    dp_unfinished: bool | None = None
    # Some row samples under a constraint: a ``GrammarBitmask`` follows this
    # message (once the step before is postprocessed), and the workers sample
    # only after it.
    awaits_bitmask: bool = False


class GrammarBitmask(msgspec.Struct, tag=True):
    """The tokens each constrained row of the step just sent may take: one
    row of ``words`` little-endian int32 words per request in ``req_ids``
    (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed; tokens past
    the last word are not). Rows of the step not named are unconstrained."""

    req_ids: list[str]
    words: int
    bitmask: bytes  # len(req_ids) * words * 4 bytes


def is_dummy(sched: SchedulerOutput) -> bool:
    """A step with nothing to compute and no request to add or move on (what lockstep runs on an engine with
    no work, even an asleep one); it may still carry requests to forget."""
    return not (sched.num_scheduled_tokens or sched.new_requests or sched.cached_requests)


class WorkerInit(msgspec.Struct, tag=True):
    """``dist_init_file``: with more than one rank, the file (in a private
    0700 directory) where the ranks meet to form their process group."""

    config: EngineConfig
    rank: int
    world_size: int
    data_parallel: DataParallelInit | None = None  # lockstep: rank 0 joins the collective
    dist_init_file: str = ""  # tensor parallel: the group's file rendezvous
    engine_index: int = 0
    local_engine_index: int = 0  # its engine core's place on this host: which accelerators (gpu/device.py)


class WorkerLoaded(msgspec.Struct, tag=True):
    """The model is loaded: what it is, and how many KV blocks this worker could hold."""

    model: ModelInfo
    max_num_kv_blocks: int


class InitKVCache(msgspec.Struct, tag=True):
    num_blocks: int


class KVCacheReady(msgspec.Struct, tag=True): ...


class PromptLogprobs(msgspec.Struct, array_like=True):
    """The logprobs of a request's prompt tokens ``start``, ``start + 1``...,
    each given the tokens before it: those a step's slice of the prompt
    computed (``SamplingParams.prompt_logprobs``)."""

    req_id: str
    start: int
    logprobs: list[SampleLogprobs]


class RunnerOutput(msgspec.Struct, tag=True):
    """One sampled token (an embedding request: its vector) for each request whose scheduled range
    reached the end, and the prompt logprobs of the step's slices that asked for them."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None = None
    dp_any_unfinished: bool | None = None  # lockstep: the collective's result (from the output rank)
    prompt_logprobs: list[PromptLogprobs] | None = None
    pooled: dict[str, bytes] | None = None  # embedding requests' vectors (float32, little-endian), not in req_ids


WorkerStage = Literal["model-load", "kv-cache", "step"]


class WorkerFailed(msgspec.Struct, tag=True):
    """A worker's last word: what went wrong, before it exits non-zero."""

    stage: WorkerStage
    message: str


class WorkerHeartbeat(msgspec.Struct, tag=True):
    """The worker is alive (sent by its own thread every ``heartbeat_interval_s``, whatever its model does)."""


class RpcRequest(msgspec.Struct, tag=True):
    """A control call for the worker, between two steps (``rpc.WorkerCall``)."""

    call: WorkerCall


class RpcReply(msgspec.Struct, tag=True):
    """The worker's answer to ``RpcRequest``: its result, or what it raised."""

    result: WorkerResult | None = None
    error: str = ""


ToWorker = WorkerInit | InitKVCache | SchedulerOutput | GrammarBitmask | RpcRequest
FromWorker = WorkerLoaded | KVCacheReady | RunnerOutput | RpcReply | WorkerFailed | WorkerHeartbeat
