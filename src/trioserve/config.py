"""Engine configuration: frozen, validated at construction, sent to every process.

A config is never mutated after it is built. What the engine learns at run
time (the number of KV blocks, the EOS ids, the context length) travels in
``EngineInfo`` (see ``messages.py``), returned when the engine is ready.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trioserve.lora import parse_lora_module


def cache_dir() -> Path:
    """Where trioserve keeps what it builds once (converted models, compiled
    kernels): ``$TRIOSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trioserve``,
    else ``~/.cache/trioserve``. A relative ``XDG_CACHE_HOME`` is ignored, as
    the XDG spec says (it would put the converted model under the working
    directory)."""
    if os.environ.get("TRIOSERVE_CACHE_DIR"):
        return Path(os.environ["TRIOSERVE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trioserve"


# Set by a ``--headless`` host for its engine cores (and so their workers): how
# many engine cores run on this host, which the head's config does not know.
ENGINES_ON_HOST_ENV = "TRIOSERVE_ENGINES_ON_HOST"


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads_per_worker(config: EngineConfig) -> int:
    """Torch intra-op threads for each worker on the CPU: ``torch_threads``
    when the config says; else ``OMP_NUM_THREADS`` when the environment says;
    else the host's cores shared out among the workers that run on it
    (tensor-parallel shards x engine cores on this host), at least one each.

    All of a 2-core host's cores for its one worker, though the engine core
    and the front-end then share them: 1.64x the tokens/s of one thread on
    the issue-13 workload (docs/benchmarks.md), the worker's idle time between
    steps growing from 0.3 to 1.8 ms on steps of 165 ms."""
    if config.torch_threads:
        return config.torch_threads
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) >= 1:  # capped as torch_threads is: threads past that fail to start
        return min(int(omp), MAX_TORCH_THREADS)
    engines = os.environ.get(ENGINES_ON_HOST_ENV, "")
    engines_here = int(engines) if engines.isdigit() and int(engines) >= 1 else max(1, config.num_local_engines)
    return max(1, usable_cores() // (config.tensor_parallel_size * engines_here))


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


_MAX_INT = 2**63 - 1  # what a message can carry to a child process
MAX_SECONDS = 1e9  # any time setting: finite, and within what threads and timers take
MAX_TORCH_THREADS = 4096
MAX_LORAS = 64  # adapters in one step (each with its slots in every layer)
MAX_LORA_RANK = 512
_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string"}


def check_types(config: Any, prefix: str = "") -> None:
    """Every field of the dataclass ``config`` holds a value of its declared
    type (its annotation: ``int``, ``float``, ``bool``, ``str``, each maybe
    ``| None``, ``tuple[str, ...]``, a ``Literal`` or a nested config), and integers fit in 64
    bits: ``ValueError`` naming the field otherwise, before any check of a
    range could fail with a ``TypeError`` or pass a value no child process
    could decode."""
    for f in dataclasses.fields(config):
        value, name = getattr(config, f.name), prefix + f.name
        kinds = [k.strip() for k in str(f.type).split("|")]
        if value is None and "None" in kinds:
            continue
        if kinds[0].startswith("Literal"):
            continue  # its own check names the values
        if kinds[0] == "FakeRunnerConfig":
            _check(isinstance(value, FakeRunnerConfig), name, "must be a FakeRunnerConfig")
            continue
        kind = kinds[0]
        if kind == "tuple[str, ...]":
            _check(isinstance(value, tuple) and all(isinstance(v, str) for v in value), name, "must be a tuple of str")
            continue
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }[kind]
        if not ok:  # (the message only now: the repr of an enormous integer fails)
            raise ValueError(f"{name}: must be {_TYPE_NAMES[kind]} (got {type(value).__name__} {value!r:.40})")
        if isinstance(value, int):  # an int where a float goes too
            _check(
                -_MAX_INT <= value <= _MAX_INT,
                name,
                f"must be at most {_MAX_INT} (got a {value.bit_length()}-bit number)",
            )


@dataclass(frozen=True, kw_only=True)
class FakeRunnerConfig:
    """Behaviour of the torch-free fake runner (``EngineConfig.runner == "fake"``).

    Tokens are deterministic: the token sampled after a sequence ending in ``t``
    is ``(t * 31 + 7) % vocab_size``, moved past the EOS id, except that EOS is
    sampled whenever the sequence length is a multiple of ``eos_every`` (when set).
    Faults are counted in model steps executed by a worker since it started (the
    first step is 1), or come with a request (``die_on_prompt_token``: one that
    kills every worker it is given to), and apply to worker ``fault_rank`` only. At run time,
    ``SIGUSR1`` to a worker makes its next step raise ``InjectedFault`` (see
    ``FakeRunner``).
    """

    vocab_size: int | None = None  # default: the model directory's config.json, else 512
    max_model_len: int = 2048
    num_kv_blocks: int = 1024
    eos_token_id: int = 2
    eos_every: int = 0  # sample EOS when the sequence length is a multiple of this (0: never)
    step_delay_s: float = 0.0
    load_delay_s: float = 0.0
    hang_at_load: bool = False
    die_at_step: int = 0  # os._exit(3) at that step (0: never)
    raise_at_step: int = 0  # raise RuntimeError at that step
    hang_at_step: int = 0  # block forever at that step
    diverge_at_step: int = 0  # sample a different token than the other ranks at that step
    die_on_prompt_token: int = -1  # os._exit(3) at a step given a request whose prompt holds this id (-1: never)
    fault_rank: int = 0  # which worker rank the faults apply to
    # Made-up logprobs for a request that asks for them (the sampled token first, then the next ids, logprob -i):
    # what they cost the front-end shows without a model (scripts/bench_held_memory.py).
    logprobs: bool = False

    def __post_init__(self) -> None:
        check_types(self, "fake.")
        _check(self.vocab_size is None or self.vocab_size >= 4, "fake.vocab_size", "must be at least 4")
        _check(self.max_model_len >= 2, "fake.max_model_len", "must be at least 2")
        _check(self.num_kv_blocks >= 1, "fake.num_kv_blocks", "must be at least 1")
        _check(self.eos_token_id >= 0, "fake.eos_token_id", "must be a token id")
        _check(self.die_on_prompt_token >= -1, "fake.die_on_prompt_token", "must be a token id, or -1")
        for name in ("eos_every", "die_at_step", "raise_at_step", "hang_at_step", "diverge_at_step", "fault_rank"):
            _check(getattr(self, name) >= 0, f"fake.{name}", "must be >= 0")
        _check(self.step_delay_s >= 0, "fake.step_delay_s", "must be >= 0")
        _check(self.load_delay_s >= 0, "fake.load_delay_s", "must be >= 0")

    @classmethod
    def from_json(cls, text: str, name: str = "fake") -> FakeRunnerConfig:
        """The config a JSON object of its fields gives; ``ValueError`` naming ``name`` otherwise."""
        try:
            options = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not JSON ({exc})") from None
        if not isinstance(options, dict):
            raise ValueError(f"{name}: must be a JSON object")
        try:
            return cls(**options)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything that shapes an engine, checked when it is built.

    ``model`` is a local directory in Hugging Face layout (``config.json``,
    weights, ``tokenizer.json``). With ``runner="fake"`` only the tokenizer and
    ``config.json`` are read, and no torch is imported anywhere.
    """

    model: str
    runner: Literal["hf", "fake"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # "int8": linear layers (all but the LM head) in int8 per output channel, activations per token (CPU, float32).
    # A compressed-tensors W8A8 checkpoint (gpu/w8a8.py) is served in int8 whatever this says; "compressed-tensors"
    # (vLLM's name) asks that the model be one.
    quantization: Literal["int8", "compressed-tensors"] | None = None
    seed: int = 0

    # Paged KV cache.
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None  # overrides the memory budget when set

    # Continuous batching.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's own context length
    # Requests in flight beyond max_num_seqs + this are refused at once with
    # EngineOverloadedError, so that a flood cannot queue without bound.
    max_waiting_requests: int = 1024
    # What one request may make the front-end hold, in entries (an output token, or one of its logprob
    # alternatives: frontend/requests/held.py), and what the requests in flight in one front-end may together.
    max_request_entries: int = 2**20
    max_held_entries: int = 2**23
    # Steps sent to the workers before the oldest one's tokens are back: with 2
    # the next step is planned and sent while the workers run the current one,
    # so they never wait on the engine core; 1 runs one step at a time.
    max_steps_in_flight: int = 2
    # Prefix caching: a full KV block is shared by every request whose tokens
    # up to its end are the same, and kept (evicted least recently used first)
    # after its last request ends, so a prompt that repeats a cached prefix
    # computes only what follows it. On by default, as in vLLM.
    enable_prefix_caching: bool = True

    # Processes.
    # Engine cores side by side (data parallel), each with its own workers;
    # new requests go to the least loaded. In lockstep, every engine steps
    # while any has work (the idle ones with dummy steps), for models whose
    # data-parallel ranks share collectives each step (docs/architecture.md).
    data_parallel_size: int = 1
    data_parallel_lockstep: bool = False
    # Workers per engine core, each holding a shard of the model (its share of
    # the attention heads and MLP columns), in one torch.distributed group.
    tensor_parallel_size: int = 1
    # Engines on other hosts (docs/deployment.md): this host runs engine cores
    # 0 .. data_parallel_size_local - 1 (all of them when None); the others
    # are headless engine cores that join over TCP at
    # tcp://data_parallel_address:data_parallel_rpc_port, authenticated and
    # encrypted with the CURVE keys in curve_keys_dir (or, with insecure_tcp,
    # in the clear and unauthenticated: for a trusted network only).
    data_parallel_size_local: int | None = None
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    curve_keys_dir: str | None = None
    insecure_tcp: bool = False
    # "ray": every engine core is placed by Ray, in a placement group of its own on a node of the
    # cluster at ray_address (or RAY_ADDRESS; a local cluster, started here, when neither is given),
    # and joins like an engine core on another host (frontend/engines/ray_backend.py).
    data_parallel_backend: str = "mp"
    ray_address: str | None = None
    torch_threads: int | None = None  # torch intra-op threads in each worker (None: cpu_threads_per_worker)
    # torch.compile the model (gpu/compiled.py) while the workers load it, so
    # that the first request does not pay for it; without tensor parallelism only.
    compile: bool = False
    # On CUDA, decode steps run eagerly rather than replayed from CUDA graphs (gpu/decode_graphs.py; vLLM's
    # --enforce-eager, which also turns compile off).
    enforce_eager: bool = False

    # Deadlines and grace periods, in seconds.
    startup_timeout_s: float = 30.0  # process spawn and handshake
    model_load_timeout_s: float = 300.0  # worker ready, model loaded
    step_timeout_s: float | None = 300.0  # one model step; past it the worker counts as hung (None: no limit)
    shutdown_grace_s: float = 5.0  # asked to stop -> SIGTERM -> SIGKILL

    # Hangs. Every process sends its parent a heartbeat each
    # heartbeat_interval_s (an engine core to the front-end, a worker to its
    # engine core), from a task or thread that runs whatever the model does;
    # one that is silent for heartbeat_timeout_s is hung (stopped, or stuck)
    # and is killed. A step that runs step_hang_factor times longer than the
    # slowest step of its size so far (and at least step_hang_min_s) is hung
    # too; so is one past step_timeout_s, whatever was measured.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    step_hang_factor: float = 50.0
    step_hang_min_s: float = 20.0

    # Supervision: an engine core that dies is restarted (with its workers),
    # after a backoff that doubles from restart_backoff_s up to
    # restart_backoff_max_s, at most max_restarts times within
    # restart_window_s. Past that budget the engine is failed for good.
    max_restarts: int = 3
    restart_window_s: float = 300.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    restart_wait_s: float = 60.0  # how long a new request waits for a restarting engine
    # A request in flight on an engine core that dies is resumed on a ready engine (another one, or the same
    # once restarted; waiting as a new request does) with its tokens so far, at most max_resumes times; beyond
    # that, or with resume_requests False, it ends with EngineDeadError (docs/supervision.md).
    resume_requests: bool = True
    max_resumes: int = 2

    # Control calls (pause, sleep, collective_rpc): how long the workers get
    # to answer one (past it they count as hung), and what a request that
    # arrives while the model sleeps does: wait for wake_up, or fail at once.
    control_timeout_s: float = 60.0
    while_asleep: Literal["wait", "fail"] = "wait"

    fake: FakeRunnerConfig = field(default_factory=FakeRunnerConfig)

    # The front-end's text (vLLM's --tokenizer and --chat-template): a directory holding tokenizer.json (None: the
    # model's), and a chat template's Jinja source (None: the model's own).
    tokenizer: str | None = None
    chat_template: str | None = None
    # A request may ask for at most this many logprobs alternatives per token (vLLM's --max-logprobs).
    max_logprobs: int = 20
    # What the engine serves: "generate" (text), "embed" (embeddings: trioserve.pooling), or "auto" (embed when
    # the model is an embedding model: sentence-transformers' files, or no generative architecture). The pooling
    # and normalisation of its vectors, where the model's files do not say (None: theirs, else last and true).
    task: Literal["auto", "generate", "embed"] = "auto"
    pooling_type: Literal["last", "mean", "cls"] | None = None
    normalize: bool | None = None
    # LoRA adapters (trioserve.lora; vLLM's --enable-lora and its options): adapters served from the start, each
    # "NAME=PATH"; at most max_loras of them in one step (each with its slots in the worker), of rank at most
    # max_lora_rank; at most max_cpu_loras kept in the worker's memory (None: every loaded one).
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # On CUDA, the share of the device's memory the worker may fill, its KV cache taking what the model leaves
    # (vLLM's --gpu-memory-utilization); None: kv_cache_memory_bytes. Refused on the CPU.
    gpu_memory_utilization: float | None = None
    # Profiling (vLLM's --profiler-dir; off when None): Engine.start_profile / stop_profile write each worker's
    # torch.profiler trace and the engine core's spans there, as Chrome trace JSON (runners/trace.py).
    profiler_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))  # a pathlib.Path is a directory path too
        if isinstance(self.profiler_dir, str | os.PathLike):  # every process writes there, whatever its directory
            object.__setattr__(self, "profiler_dir", os.path.abspath(self.profiler_dir))
        check_types(self)
        _check(self.model != "", "model", "must be a directory path")
        _check(self.runner in ("hf", "fake"), "runner", "must be 'hf' or 'fake'")
        _check(self.device in ("auto", "cpu", "cuda"), "device", "must be 'auto', 'cpu' or 'cuda'")
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "must be 'auto', 'float32', 'bfloat16' or 'float16'",
        )
        _check(
            self.quantization in (None, "int8", "compressed-tensors"),
            "quantization",
            "must be 'int8', 'compressed-tensors' (a W8A8 checkpoint's own) or None (the checkpoint's own dtype)",
        )
        if self.quantization is not None:
            _check(
                self.device != "cuda" and self.dtype in ("auto", "float32"),
                "quantization",
                "int8 runs on the CPU at float32",
            )
            _check(self.task != "embed", "quantization", "int8 serves text generation, not embeddings, yet")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "must be a power of two <= 128")
        _check(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _check(0 <= self.max_logprobs <= 20, "max_logprobs", "must be in [0, 20]")
        _check(self.task in ("auto", "generate", "embed"), "task", "must be 'auto', 'generate' or 'embed'")
        _check(self.pooling_type in (None, "last", "mean", "cls"), "pooling_type", "must be 'last', 'mean' or 'cls'")
        _check(
            self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )
        _check(
            self.gpu_memory_utilization is None or self.device != "cpu",
            "gpu_memory_utilization",
            "sizes the KV cache from an accelerator's free memory, and the CPU has none to share: "
            "size it with --kv-cache-mib (kv_cache_memory_bytes)",
        )
        _check(isinstance(self.enable_lora, bool), "enable_lora", "must be True or False")
        _check(1 <= self.max_loras <= MAX_LORAS, "max_loras", f"must be in [1, {MAX_LORAS}]")
        _check(1 <= self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank", f"must be in [1, {MAX_LORA_RANK}]")
        _check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            "must be at least max_loras (or None)",
        )
        _check(self.enable_lora or not self.lora_modules, "lora_modules", "needs enable_lora (--enable-lora)")
        names = [parse_lora_module(spec)[0] for spec in self.lora_modules]  # ValueError naming a bad one
        _check(len(set(names)) == len(names), "lora_modules", "names an adapter twice")
        if self.enable_lora:
            _check(not self.compile, "compile", "does not run with LoRA adapters yet (enable_lora)")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.max_waiting_requests >= 0, "max_waiting_requests", "must be >= 0")
        _check(self.max_request_entries >= 1, "max_request_entries", "must be >= 1")
        _check(self.max_held_entries >= self.max_request_entries, "max_held_entries", "must be >= max_request_entries")
        _check(self.max_steps_in_flight in (1, 2), "max_steps_in_flight", "must be 1 or 2")
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be True or False")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size", "must be in [1, 64]")
        _check(1 <= self.data_parallel_size <= 64, "data_parallel_size", "must be in [1, 64]")
        _check(
            self.data_parallel_size_local is None or 0 <= self.data_parallel_size_local <= self.data_parallel_size,
            "data_parallel_size_local",
            "must be in [0, data_parallel_size]",
        )
        _check(self.data_parallel_backend in ("mp", "ray"), "data_parallel_backend", "must be 'mp' or 'ray'")
        if self.data_parallel_backend == "ray":
            _check(
                self.data_parallel_size_local is None,
                "data_parallel_size_local",
                "with the ray backend Ray places every engine core: leave it unset",
            )
            _check(not self.data_parallel_lockstep, "data_parallel_lockstep", "is not supported on Ray yet")
            _check(
                0 <= self.data_parallel_rpc_port < 65536,
                "data_parallel_rpc_port",
                "must be a TCP port, or 0 for one the kernel picks",
            )
        elif self.num_remote_engines:
            _check(
                0 < self.data_parallel_rpc_port < 65536,
                "data_parallel_rpc_port",
                "must be a TCP port when engines join from other hosts (data_parallel_size_local < data_parallel_size)",
            )
            _check(
                self.curve_keys_dir is not None or self.insecure_tcp,
                "curve_keys_dir",
                "engines on other hosts join over TCP: give CURVE keys (`trioserve keys DIR`), or say insecure_tcp",
            )
            _check(not self.data_parallel_lockstep, "data_parallel_lockstep", "is not supported across hosts yet")
        _check(self.while_asleep in ("wait", "fail"), "while_asleep", "must be 'wait' or 'fail'")
        _check(isinstance(self.compile, bool), "compile", "must be True or False")
        _check(
            self.torch_threads is None or 1 <= self.torch_threads <= MAX_TORCH_THREADS,
            "torch_threads",
            f"must be in [1, {MAX_TORCH_THREADS}]",
        )
        positive = (
            "startup_timeout_s", "model_load_timeout_s", "shutdown_grace_s", "restart_window_s",
            "heartbeat_interval_s", "step_hang_min_s", "control_timeout_s",
        )  # fmt: skip
        for name in positive:
            _check(getattr(self, name) > 0, name, "must be > 0")
        finite = (
            "heartbeat_timeout_s", "step_timeout_s", "restart_backoff_s", "restart_backoff_max_s", "restart_wait_s",
            "step_hang_factor",
        )  # fmt: skip
        for name in positive + finite:
            value = getattr(self, name)
            _check(value is None or value <= MAX_SECONDS, name, f"must be at most {MAX_SECONDS:g} (a finite number)")
        _check(
            self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            "must be at least twice heartbeat_interval_s",
        )
        _check(self.step_hang_factor >= 2, "step_hang_factor", "must be >= 2")
        _check(self.step_timeout_s is None or self.step_timeout_s > 0, "step_timeout_s", "must be > 0 (or None)")
        _check(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        _check(self.max_resumes >= 0, "max_resumes", "must be >= 0")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_wait_s"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")

    @property
    def num_local_engines(self) -> int:
        """Engine cores this host runs (ranks 0 .. num_local_engines - 1)."""
        if self.data_parallel_backend == "ray":
            return 0  # all of them placed by Ray, joining as from other hosts
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def num_remote_engines(self) -> int:
        """Engine cores that join from other hosts."""
        return self.data_parallel_size - self.num_local_engines

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
