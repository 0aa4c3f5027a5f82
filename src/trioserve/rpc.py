"""Control calls: the closed, typed set of things the front-end may ask an
engine core, and an engine core its workers, besides serving requests.

Nothing here is code: every call is a ``msgspec.Struct`` of a tagged union,
decoded with its type, and each worker answers it with a typed result. A new
kind of call is a new struct here and a branch in the code that runs it
(``nurseries/engine_core/control.py`` in the engine core, ``nurseries/worker/main.py`` in a
worker); nothing else can cross.

Two levels:

- ``WorkerCall``: run by every worker of an engine core, between two model
  steps (``collective_rpc``); each rank answers with a ``WorkerResult``.
- ``ControlCall``: sent by the front-end to every engine core, each with a
  ``call_id`` and a deadline (``ControlRequest``); answered with one
  ``ControlReply`` per engine core. Besides passing a ``WorkerCall`` on
  (``CollectiveRpc``), they pause and resume generation and put the model
  to sleep and wake it up.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PauseMode = Literal["wait", "abort"]  # running requests finish, or are aborted
SleepLevel = Literal[1, 2]  # 1: the KV cache is freed; 2: the weights too


# --- worker calls ------------------------------------------------------------


class DescribeShard(msgspec.Struct, tag=True, frozen=True):
    """Each rank's share of the model and of the KV cache, and its memory."""


class SleepShard(msgspec.Struct, tag=True, frozen=True):
    """Free the KV cache (level 1), and the weights too (level 2)."""

    level: SleepLevel = 1


class WakeShard(msgspec.Struct, tag=True, frozen=True):
    """Load what ``SleepShard`` freed (the weights from the model directory,
    a zeroed KV cache of the same size). A no-op when awake."""


class Echo(msgspec.Struct, tag=True, frozen=True):
    """A diagnostic: every rank answers ``text`` with its rank and pid; the
    rank ``fail_on_rank`` (if any) raises instead, which shows what a failing
    call looks like without harming anything."""

    text: str = ""
    fail_on_rank: int | None = None


class LoadAdapter(msgspec.Struct, tag=True, frozen=True):
    """Read and check the LoRA adapter at ``path`` (a directory on the
    worker's host), known from now on as ``name``; answered with its ``LoraInfo``."""

    name: str
    path: str


class DropAdapter(msgspec.Struct, tag=True, frozen=True):
    """Forget the adapter ``name`` (no request runs with it any more)."""

    name: str


class PinAdapter(msgspec.Struct, tag=True, frozen=True):
    """Keep adapter ``name`` in memory whatever ``max_cpu_loras`` says."""

    name: str


class ProfileShard(msgspec.Struct, tag=True, frozen=True):
    """Start recording a profile of the steps (``start``), or stop and write
    it to ``trace_prefix`` + ``-rank-<rank>.trace.json`` (Chrome trace JSON;
    with no prefix, drop it); answered with its ``TraceFile``."""

    start: bool
    trace_prefix: str = ""


WorkerCall = DescribeShard | SleepShard | WakeShard | Echo | LoadAdapter | DropAdapter | PinAdapter | ProfileShard
# What ``collective_rpc`` may run: sleeping and waking go through ``Sleep``
# and ``WakeUp``, which the engine core must know about.
CollectiveCall = DescribeShard | Echo


class ShardInfo(msgspec.Struct, tag=True, frozen=True):
    """One rank's part of the model (``DescribeShard``, and the answer to
    ``SleepShard`` and ``WakeShard``). Sizes are of this rank's own shard:
    with tensor parallelism the sharded weights and the KV heads are split
    across ranks, and what is replicated (norms) counts on every rank."""

    engine_index: int
    rank: int
    world_size: int
    pid: int
    architecture: str  # the model class, e.g. LlamaForCausalLM ("fake" for the fake runner)
    num_parameters: int  # elements of this rank's weights (0 while asleep at level 2)
    parameter_bytes: int
    num_kv_heads: int  # KV heads this rank's cache holds, per layer
    num_kv_blocks: int
    kv_cache_bytes: int  # 0 while asleep
    rss_bytes: int  # the worker process's resident memory
    device_memory_bytes: int  # allocated on the accelerator (0 on the CPU)
    sleep_level: int  # 0: awake


class EchoReply(msgspec.Struct, tag=True, frozen=True):
    rank: int
    pid: int
    text: str


class LoraInfo(msgspec.Struct, tag=True, frozen=True):
    """A LoRA adapter an engine serves: its name, directory and rank, and
    whether it is pinned (never dropped from the workers' memory)."""

    name: str
    path: str
    rank: int
    pinned: bool = False


class TraceFile(msgspec.Struct, tag=True, frozen=True):
    """A profile trace written (``ProfileShard``, ``StopProfile``): its path,
    and the rank that wrote it (-1: the engine core's own spans; ``path`` is
    empty while the recording has only started)."""

    path: str
    rank: int


WorkerResult = ShardInfo | EchoReply | LoraInfo | TraceFile


# --- control calls (front-end -> engine core) -------------------------------


class Pause(msgspec.Struct, tag=True, frozen=True):
    """Stop generating: requests that arrive wait until ``Resume``; those the
    engine core holds already finish (``wait``) or are aborted (``abort``).
    Answered once none runs."""

    mode: PauseMode = "wait"


class Resume(msgspec.Struct, tag=True, frozen=True):
    """Generate again after ``Pause``: the requests that waited start."""


class Sleep(msgspec.Struct, tag=True, frozen=True):
    """Pause (in ``mode``), then free memory on every worker (``SleepShard``).
    Requests that arrive while asleep wait or fail
    (``EngineConfig.while_asleep``)."""

    level: SleepLevel = 1
    mode: PauseMode = "wait"


class WakeUp(msgspec.Struct, tag=True, frozen=True):
    """Restore what ``Sleep`` freed and generate again (unless also paused)."""


class CollectiveRpc(msgspec.Struct, tag=True, frozen=True):
    """Run ``call`` on every worker between two steps; every rank's result."""

    call: CollectiveCall


class AddLora(msgspec.Struct, tag=True, frozen=True):
    """Load the adapter at ``path`` on every worker as ``name`` (refused if
    that name is taken); answered with its ``LoraInfo`` from each rank."""

    name: str
    path: str


class RemoveLora(msgspec.Struct, tag=True, frozen=True):
    """Stop serving adapter ``name``: requests naming it from now on fail;
    answered once those already running with it have finished, and it is
    dropped."""

    name: str


class PinLora(msgspec.Struct, tag=True, frozen=True):
    """Keep adapter ``name`` in the workers' memory whatever ``max_cpu_loras`` says."""

    name: str


class ListLoras(msgspec.Struct, tag=True, frozen=True):
    """Every adapter the engine serves, as ``LoraInfo``s."""


class StartProfile(msgspec.Struct, tag=True, frozen=True):
    """Record a profile from now on: every worker a ``torch.profiler`` trace
    (``ProfileShard``), the engine core the spans of its step loop. The
    traces of one recording are named with ``session`` (letters, digits and
    dashes), in ``EngineConfig.profiler_dir``."""

    session: str


class StopProfile(msgspec.Struct, tag=True, frozen=True):
    """Stop recording, and write every trace; answered with their ``TraceFile``s."""


LoraCall = AddLora | RemoveLora | PinLora | ListLoras
ControlCall = (
    Pause | Resume | Sleep | WakeUp | CollectiveRpc | AddLora | RemoveLora | PinLora | ListLoras | StartProfile
    | StopProfile
)  # fmt: skip


class ControlRequest(msgspec.Struct, tag=True):
    call_id: int
    call: ControlCall
    timeout_s: float  # what the workers get to answer; past it they count as hung


class GenerationState(msgspec.Struct, frozen=True):
    """An engine core's own word on whether it generates: ``paused`` by a
    ``Pause`` not yet resumed; its workers asleep (``sleep_level`` 1 or 2) or
    not (0); ``holding`` new requests (paused, asleep, or a ``Sleep`` waiting
    for the requests to end). Sent with every reply to a call and every
    heartbeat, to every front-end of the engine core, so that each one's
    ``health`` (and what it asks of the engine core's next life) is the
    engine core's state, whoever changed it."""

    paused: bool = False
    sleep_level: int = 0
    holding: bool = False


class ControlReply(msgspec.Struct, tag=True):
    """One engine core's answer: each rank's result (``CollectiveRpc``,
    ``Sleep``, ``WakeUp``), or ``error`` naming the rank that failed; and
    the engine core's state after the call."""

    call_id: int
    results: list[WorkerResult] = msgspec.field(default_factory=list)
    error: str = ""
    state: GenerationState = GenerationState()
