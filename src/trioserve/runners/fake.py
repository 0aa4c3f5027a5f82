"""A model runner that imports no torch: deterministic tokens, delays, faults.

It mirrors the workers' per-request state exactly as the real runner does
(dropping finished requests, adding new ones, appending new tokens), so the
lifecycle tests exercise the same messages as a real model, only faster.
Faults are chosen by ``FakeRunnerConfig`` so tests drive real processes, or
injected at run time with ``SIGUSR1`` (see ``FakeRunner``).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import trio

from trioserve.config import EngineConfig
from trioserve.lora import parse_lora_module, read_adapter_config
from trioserve.messages import (
    GrammarBitmask,
    ModelInfo,
    RunnerOutput,
    SampleLogprobs,
    SchedulerOutput,
    WorkerLoaded,
    is_dummy,
)
from trioserve.pooling import FAKE_HIDDEN_SIZE, PoolingParams, fake_vector
from trioserve.rpc import ShardInfo
from trioserve.runners.trace import SpanTrace

FAULT_SIGNAL = signal.SIGUSR1


class InjectedFault(RuntimeError):
    """Raised by the fake runner when a test asked it to fail."""


class FakeRunner:
    """The torch-free runner, with the faults ``FakeRunnerConfig`` selects.

    Run-time fault injection: once a ``FakeRunner`` is built, ``SIGUSR1``
    sent to its worker process makes the worker's *next* step raise
    ``InjectedFault`` (whatever its rank; a step already running finishes
    normally). The worker then reports ``WorkerFailed`` and exits 1, and the
    engine core dies with that reason, as for ``raise_at_step``. Signals that
    arrive before that step count once. A worker that is idle is not
    disturbed: the handler only sets a flag. The handler is installed when
    the runner is built (on the worker's ``WorkerInit``), in the worker's
    main thread; a ``SIGUSR1`` that arrives before then (while the worker
    process starts) still has its default effect and kills the worker.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, *, engine_index: int = 0) -> None:
        self.config = config
        self.fake = config.fake
        self.rank = rank
        self.world_size = world_size
        self.engine_index = engine_index
        self.num_steps = 0
        self.num_blocks = 0
        self.sleep_level = 0
        self.vocab_size = self.fake.vocab_size or self._model_vocab_size()
        self._tokens: dict[str, list[int]] = {}
        self._num_logprobs: dict[str, int] = {}  # with fake.logprobs: the alternatives each request asked for
        self._pooling: dict[str, PoolingParams] = {}  # embedding requests
        self.adapters: dict[str, int] = {}  # LoRA adapters' ranks: a request with one has its tokens shifted by it
        self._lora: dict[str, str] = {}  # requests with an adapter
        self._fault_requested = False  # set by SIGUSR1
        self._trace: SpanTrace | None = None  # while profiling: each step's span
        self._install_fault_signal()

    def _install_fault_signal(self) -> None:
        """Install the ``SIGUSR1`` handler in the main thread: directly when
        this runs there, else through Trio when this runs in a Trio worker
        thread (the worker builds its runner off the Trio thread). Elsewhere
        (a runner built in some other thread) no handler is installed."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._fault_requested = True

        if threading.current_thread() is threading.main_thread():
            signal.signal(FAULT_SIGNAL, on_signal)
            return
        try:
            trio.from_thread.run_sync(signal.signal, FAULT_SIGNAL, on_signal)
        except RuntimeError:  # not in a Trio worker thread
            pass

    def _model_vocab_size(self) -> int:
        path = Path(self.config.model) / "config.json"
        if path.exists():
            return int(json.loads(path.read_text()).get("vocab_size", 512))
        return 512

    def _faults_apply(self) -> bool:
        return self.rank == self.fake.fault_rank

    def load(self) -> WorkerLoaded:
        if self._faults_apply() and self.fake.hang_at_load:
            while True:
                time.sleep(3600)
        time.sleep(self.fake.load_delay_s)
        max_model_len = self.fake.max_model_len
        if self.config.max_model_len is not None:
            max_model_len = min(max_model_len, self.config.max_model_len)
        model = ModelInfo(self.vocab_size, max_model_len, [self.fake.eos_token_id], hidden_size=FAKE_HIDDEN_SIZE)
        for name, path in map(parse_lora_module, self.config.lora_modules):
            self.load_adapter(name, path)
        return WorkerLoaded(model=model, max_num_kv_blocks=self.config.num_kv_blocks or self.fake.num_kv_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def describe(self) -> ShardInfo:
        """No model: sizes are 0 but for the blocks; a copy per rank, not a shard."""
        return ShardInfo(
            engine_index=self.engine_index, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
            architecture="fake", num_parameters=0, parameter_bytes=0, num_kv_heads=0,
            num_kv_blocks=self.num_blocks, kv_cache_bytes=0, rss_bytes=0, device_memory_bytes=0,
            sleep_level=self.sleep_level,
        )  # fmt: skip

    def sleep(self, level: int) -> None:
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        self.sleep_level = 0

    def load_adapter(self, name: str, path: str) -> int:
        """Its config checked (no weights: the fake model has no layers); its rank."""
        config = read_adapter_config(path, self.config.max_lora_rank)
        self.adapters[name] = config.r
        return config.r

    def drop_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def pin_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")

    def start_profile(self) -> None:
        """Record each step's span (a Chrome trace: there is no torch to profile)."""
        if self._trace is not None:
            raise RuntimeError("a profile is already being recorded")
        self._trace = SpanTrace(f"engine-core-{self.engine_index} worker-{self.rank} (fake runner)")

    def stop_profile(self, path: str) -> None:
        trace, self._trace = self._trace, None
        if trace is None:
            raise RuntimeError("no profile is being recorded")
        if path:  # else dropped
            trace.write(path)

    def next_token(self, tokens: list[int]) -> int:
        """The deterministic token that follows ``tokens``."""
        fake = self.fake
        if fake.eos_every and len(tokens) % fake.eos_every == 0:
            return fake.eos_token_id
        token = (tokens[-1] * 31 + 7) % self.vocab_size
        if token == fake.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    def _inject_faults(self) -> None:
        fake = self.fake
        if self._fault_requested:
            self._fault_requested = False
            raise InjectedFault(f"fake runner: failure injected by {FAULT_SIGNAL.name} at step {self.num_steps}")
        if not self._faults_apply():
            return
        if self.num_steps == fake.die_at_step:
            os._exit(3)
        if self.num_steps == fake.raise_at_step:
            raise InjectedFault(f"fake runner: injected failure at step {self.num_steps}")
        if self.num_steps == fake.hang_at_step:
            while True:
                time.sleep(3600)

    def execute(self, sched: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None = None) -> RunnerOutput:
        if self._trace is None:
            return self._execute(sched, bitmask)
        with self._trace.span("fake_step"):
            return self._execute(sched, bitmask)

    def _execute(self, sched: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None) -> RunnerOutput:
        if self.sleep_level and is_dummy(sched):  # lockstep: an asleep engine still steps with its peers
            for req_id in sched.finished_req_ids:
                self._tokens.pop(req_id, None)
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        if self.sleep_level:
            raise RuntimeError("fake runner: a step while asleep")
        self.num_steps += 1
        self._inject_faults()
        for req_id in sched.finished_req_ids:
            self._tokens.pop(req_id, None)
            self._num_logprobs.pop(req_id, None)
            self._pooling.pop(req_id, None)
            self._lora.pop(req_id, None)
        for new in sched.new_requests:
            if self._faults_apply() and self.fake.die_on_prompt_token in new.token_ids[: new.num_prompt_tokens]:
                os._exit(3)  # a request that kills every engine it is given to
            self._tokens[new.req_id] = list(new.token_ids)
            if new.params.lora is not None:
                if new.params.lora not in self.adapters:
                    raise ValueError(f"new_requests: {new.req_id!r} names adapter {new.params.lora!r}, not loaded")
                self._lora[new.req_id] = new.params.lora
            if new.params.pooling is not None:
                self._pooling[new.req_id] = new.params.pooling
            if self.fake.logprobs and new.params.logprobs is not None:
                self._num_logprobs[new.req_id] = new.params.logprobs
        num_computed = {r.req_id: r.num_computed_tokens for r in sched.new_requests}
        num_computed.update({r.req_id: r.num_computed_tokens for r in sched.cached_requests})
        allowed = _allowed_rows(sched, bitmask)
        in_step = {self._lora[r] for r in sched.num_scheduled_tokens if r in self._lora}
        if len(in_step) > self.config.max_loras:
            raise ValueError(f"a step of {len(in_step)} adapters, and {self.config.max_loras} slots (max_loras)")
        req_ids, sampled, pooled = [], [], {}
        for req_id, n in sched.num_scheduled_tokens.items():
            tokens = self._tokens[req_id]
            if num_computed[req_id] + n == len(tokens) and req_id in self._pooling:  # an embedding request
                vector = fake_vector(tokens, self._pooling[req_id])
                pooled[req_id] = struct.pack(f"<{len(vector)}f", *vector)
            elif num_computed[req_id] + n == len(tokens):
                req_ids.append(req_id)
                token = self.next_token(tokens)
                if req_id in self._lora and token != self.fake.eos_token_id:
                    token = (token + self.adapters[self._lora[req_id]]) % self.vocab_size
                if req_id in allowed:  # the first allowed token from the deterministic one on, cyclically
                    token = _first_allowed(allowed[req_id], token)
                sampled.append(token)
                if self._faults_apply() and self.num_steps == self.fake.diverge_at_step:
                    sampled[-1] = (sampled[-1] + 1) % self.vocab_size  # this rank disagrees
                tokens.append(sampled[-1])  # as a real runner does: the next step computes it
        if self.fake.step_delay_s:
            time.sleep(self.fake.step_delay_s)
        if not self._num_logprobs:
            return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, pooled=pooled or None)
        logprobs = [self._made_up_logprobs(r, t) for r, t in zip(req_ids, sampled, strict=True)]
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, pooled=pooled or None)

    def _made_up_logprobs(self, req_id: str, token: int) -> SampleLogprobs | None:
        k = self._num_logprobs.get(req_id)
        if k is None:
            return None
        top = [(token + i) % self.vocab_size for i in range(k)]
        return SampleLogprobs(0.0, top, [-float(i) for i in range(k)], rank=1)


def _allowed_rows(sched: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None) -> dict[str, int]:
    """Each constrained row's bitmask as one int (bit t: token t allowed);
    none for a step that does not await a bitmask."""
    if not sched.awaits_bitmask:
        return {}
    if bitmask is None:
        raise ValueError("a step that awaits a grammar bitmask, and no way to receive it")
    mask = bitmask()
    size = mask.words * 4
    rows = {}
    for i, req_id in enumerate(mask.req_ids):
        rows[req_id] = int.from_bytes(mask.bitmask[i * size : (i + 1) * size], "little")
        if not rows[req_id]:
            raise ValueError(f"grammar bitmask: request {req_id!r} may take no token")
    return rows


def _first_allowed(row: int, token: int) -> int:
    """The lowest allowed token at or above ``token``, else the lowest allowed."""
    above = row >> token
    if above:
        return token + (above & -above).bit_length() - 1
    return (row & -row).bit_length() - 1
