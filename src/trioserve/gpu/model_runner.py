"""The model runner: one transformers model, a paged KV cache, one packed
model call per scheduler step.

The runner keeps, per request, what the scheduler has told it (the prompt, and every output token so far when a
request is sent again after a preemption), the block table, and how many tokens are in the cache; and it appends
every token it samples to the request's token list, so that the next step can compute it before the engine core
has seen it (``CachedRequestData`` carries no tokens).

Invariants: a request is in ``requests`` from its ``NewRequestData`` until its
id appears in ``finished_req_ids``; every scheduled range lies inside the
request's token list and its block table.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trioserve.config import EngineConfig, cpu_threads_per_worker
from trioserve.gpu import sharding
from trioserve.gpu.attention import (
    ATTENTION_NAME,
    DecodeKernel,
    KVCache,
    PagedAttentionMetadata,
    PrefillKernel,
    attention_kernels,
    build_metadata,
    step_metadata,
)
from trioserve.gpu.compiled import Forward, compiled_forward, eager_forward, inductor_cache_dir
from trioserve.gpu.cpu_kernels.fused import fuse_elementwise
from trioserve.gpu.cpu_kernels.host_memory import keep_freed_memory, release_freed_memory, resident_bytes
from trioserve.gpu.cpu_kernels.int8 import calibration_ids, quantize_linears
from trioserve.gpu.cpu_kernels.linear import pack_linears, packing_supported
from trioserve.gpu.cuda_memory import activation_peak_bytes, kv_budget_bytes, profile_lengths
from trioserve.gpu.decode_graphs import (
    GRAPHS_ENV,
    Capture,
    DecodeGraphs,
    DecodeRows,
    cuda_capture,
    eager_capture,
    graph_buckets,
)
from trioserve.gpu.device import available_memory, resolve_device, resolve_dtype
from trioserve.gpu.grammar_bitmask import apply_grammar_bitmask
from trioserve.gpu.logits_processing import RowProcessors
from trioserve.gpu.lora import LoraLayers, attach_lora
from trioserve.gpu.pooler import Pooler, PoolingPlan, encoder_hidden, hidden_forward
from trioserve.gpu.profiler import TorchProfiling
from trioserve.gpu.prompt_logprobs import PromptLogprobsPlan
from trioserve.gpu.sampler import SamplingBatch, sample
from trioserve.gpu.w8a8 import load_w8a8, read_scheme, without_quantization
from trioserve.messages import (
    CachedRequestData,
    GrammarBitmask,
    ModelInfo,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    WorkerLoaded,
    is_dummy,
)
from trioserve.pooling import engine_pooling
from trioserve.rpc import ShardInfo
from trioserve.runners.steplog import STEP_LOG_ENV, StepRecord, format_step, step_log_path
from trioserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

KV_MEMORY_SHARE = 0.9  # the most of the memory available at allocation that the KV cache may take


@dataclass
class _Request:
    params: SamplingParams
    token_ids: list[int]  # prompt + outputs: what the scheduler sent, then each token sampled here
    block_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    processors: RowProcessors | None = None  # its logits processing (gpu/logits_processing.py)
    # Prompt logprobs still to compute: asked for, and no output yet (with one,
    # the engine core has had them all, with the first token).
    wants_prompt_logprobs: bool = False


@dataclass
class _Step:
    """The packed batch of one step, as plain Python, before it meets the device."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # packed index of the last token of each sampling request
    sample_req_ids: list[str]
    prompt_logprobs: PromptLogprobsPlan = field(default_factory=PromptLogprobsPlan)
    pooling: PoolingPlan = field(default_factory=PoolingPlan)


class ModelRunner(TorchProfiling):
    """Runs a transformers causal LM over a paged KV cache.

    Call ``load()``, then ``init_kv_cache(n)``, then ``execute(step)`` once per scheduler step. Not thread-safe;
    one runner per worker process. With ``TRIOSERVE_STEP_LOG`` in the environment it logs each step's timing
    (``trioserve.runners.steplog``); from ``start_profile`` to ``stop_profile``, a profile (``gpu/profiler.py``).
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        *,
        dist_init_file: str = "",
        engine_index: int = 0,
        local_engine_index: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.engine_index = engine_index
        self._dist_init_file = dist_init_file  # where the ranks meet (tensor parallelism)
        self.device = resolve_device(config.device, rank, local_engine_index, world_size)  # (gpu/device.py)
        self.sleep_level = 0
        self.architecture = ""  # the model class, once loaded
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model: torch.nn.Module | None = None
        self.compiled = config.compile and world_size == 1
        if config.compile and world_size > 1:
            log.warning("compile: tensor-parallel shards run eager")
        self.compile_seconds = 0.0  # the last warm-up's, compilation included
        self._forward: Forward | None = None  # the model's forward: eager, or compiled (gpu/compiled.py)
        self._decode_kernel: DecodeKernel | None = None  # decodes reading the cache in place (attention_kernels)
        self._prefill_kernel: PrefillKernel | None = None  # all the step's prefills in one call (CUDA)
        self._graphs: DecodeGraphs | None = None  # decode steps replayed (gpu/decode_graphs.py)
        self.max_model_len = 0  # once loaded
        self.kv_caches: KVCache = []
        self.num_blocks = 0
        self.requests: dict[str, _Request] = {}
        self.lora: LoraLayers | None = None  # LoRA adapters' slots (gpu/lora.py), with enable_lora
        pooling = engine_pooling(config)
        self.pooler = None if pooling is None else Pooler()  # an embedding engine
        self._encoder = pooling is not None and pooling.encoder
        self.eos_token_ids: list[int] = []  # the model's, once loaded
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_worker(config))
            keep_freed_memory()  # else every step faults its temporaries in afresh
        # Every rank draws the same unseeded noise, so tensor-parallel ranks agree.
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # Benchmarks ask for each step's timing (trioserve.runners.steplog); a line per step.
        log_base = os.environ.get(STEP_LOG_ENV)
        # The runner's own file, open as long as the runner (a worker process ends without teardown).
        self._step_log = open(step_log_path(log_base, rank), "w", buffering=1) if log_base else None  # noqa: SIM115

    # --- start-up -----------------------------------------------------------

    def load(self) -> WorkerLoaded:
        """Load the model (with tensor parallelism, join the ranks' process
        group and load this rank's shard); say how many KV blocks the memory
        budget allows. A model that cannot be sharded raises
        ``NotShardableError`` naming its architecture, before any collective."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a worker's stderr is the operator's log
        if self.world_size > 1:
            sharding.check_shardable(self.config.model, self.world_size)
            timeout_s = max(self.config.model_load_timeout_s, self.config.step_timeout_s or 0.0)
            sharding.init_process_group(self.rank, self.world_size, self._dist_init_file, self.device, timeout_s)
        model = self._load_model()
        text = model.config.get_text_config()
        self.architecture = type(model).__name__
        self.vocab_size = text.vocab_size
        self.num_layers = text.num_hidden_layers
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        heads = (
            sharding.kv_heads_per_rank(model.tp_plan, num_kv_heads, self.world_size) if self.world_size > 1 else None
        )
        self.num_kv_heads = heads or num_kv_heads  # this rank's share
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        model_len = text.max_position_embeddings
        if model_len < 2:
            raise ValueError(
                f"{self.config.model}: config.json's max_position_embeddings is {model_len}: a model's context "
                "must hold at least 2 tokens (a prompt token and an output token)"
            )
        if self.config.max_model_len is not None and self.config.max_model_len > model_len:
            # Past its positions a model fails (learned position embeddings index out of range) or
            # silently degrades (rotary ones were never trained there).
            raise ValueError(
                f"max_model_len: {self.config.max_model_len} is more than this model's context, "
                f"{model_len} tokens (max_position_embeddings in {self.config.model}/config.json)"
            )
        max_model_len = self.max_model_len = self.config.max_model_len or model_len
        self.eos_token_ids = sharding.eos_token_ids(model)
        info = ModelInfo(self.vocab_size, max_model_len, self.eos_token_ids, hidden_size=text.hidden_size)
        return WorkerLoaded(
            model=info, max_num_kv_blocks=self.config.num_kv_blocks or self._blocks_for_budget(max_model_len)
        )

    def _load_model(self) -> PreTrainedModel:
        """Load the weights (this rank's shard) onto the device: ``self.model``."""
        torch.manual_seed(self.config.seed)
        base = self.pooler is not None  # an embedding model: hidden states, no head
        attention = "sdpa" if self._encoder else ATTENTION_NAME  # an encoder attends both ways, without the cache
        kwargs: dict[str, Any] = {}
        scheme = read_scheme(self.config.model)  # a compressed-tensors W8A8 checkpoint (gpu/w8a8.py), or None
        if scheme is None and self.config.quantization == "compressed-tensors":
            raise ValueError(f"quantization: {self.config.model}/config.json has no compressed-tensors W8A8 scheme")
        if scheme is not None:  # loaded as a float model (its int8 weights exactly), then swapped: load_w8a8
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError(
                    f"{self.config.model} is a W8A8 int8 checkpoint: it runs on the CPU at float32 "
                    f"(this worker: {self.device.type}, {self.dtype})"
                )
            from transformers import AutoConfig

            kwargs["config"] = without_quantization(AutoConfig.from_pretrained(self.config.model))
        model = sharding.load_model(
            self.config.model, self.world_size, base=base, w8a8=scheme is not None, attn_implementation=attention,
            dtype=self.dtype, **kwargs,
        )  # fmt: skip
        self.model = torch.nn.Module.to(model, self.device).eval().requires_grad_(False)
        self._decode_kernel, self._prefill_kernel = attention_kernels(self.device, self.dtype)
        if base and (self.config.enable_lora or self.config.quantization or scheme is not None):
            what = "enable_lora: LoRA adapters" if self.config.enable_lora else "quantization: int8 layers"
            raise ValueError(f"{what} serve text generation, and this model serves embeddings")
        if scheme is not None:  # int8 as the checkpoint stores it (whatever --quantization says)
            swapped = load_w8a8(model, scheme)
            log.info("%s: a W8A8 int8 checkpoint, %d linear layers in int8", self.config.model, swapped)
        elif self.config.quantization == "int8":  # all but the LM head, smoothed (gpu/cpu_kernels/int8.py)
            ids = calibration_ids(self.config.tokenizer or self.config.model)
            quantize_linears(model, self.device, self.dtype, calibration_ids=ids)
        # Our panels or oneDNN's blocked weights (gpu/cpu_kernels/linear.py): not for embeddings (all prefill: slower)
        if self.world_size == 1 and packing_supported(self.device, self.dtype) and not base:
            pack_linears(model, rows=(self.config.max_num_seqs, self.config.max_num_batched_tokens))
        self.lora = attach_lora(model, self.config, self.device, self.dtype, self.lora)  # after packing: its hooks
        # One call per RMSNorm and per MLP's SiLU x up (gpu/cpu_kernels/fused.py; inductor fuses them itself)
        eager_cpu = self.device.type == "cpu" and not self.compiled and self.world_size == 1
        if eager_cpu and self.dtype == torch.float32 and not base:
            norms, mlps = fuse_elementwise(model)
            log.debug("fused element-wise work: %d norms, %d MLPs", norms, mlps)
        if base:
            self._forward = hidden_forward(model)  # eager (--compile covers generation)
        else:
            self._forward = compiled_forward(model) if self.compiled else eager_forward(model)
        return model

    def _blocks_for_budget(self, max_model_len: int) -> int:
        """As many blocks as the memory budget holds, but no more than every
        sequence of a full batch at full context length could use."""
        by_memory = self._kv_budget_bytes() // self.bytes_per_block
        per_sequence = -(-max_model_len // self.block_size)
        return max(1, min(by_memory, per_sequence * self.config.max_num_seqs))

    def _kv_budget_bytes(self) -> int:
        """``kv_cache_memory_bytes``; with ``gpu_memory_utilization``, what
        that share of the CUDA device leaves after what is in use now (the
        model loaded)."""
        share = self.config.gpu_memory_utilization
        if share is None:
            return self.config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            raise ValueError(
                "gpu_memory_utilization (--gpu-memory-utilization) sizes the KV cache from CUDA memory, and this "
                f"worker runs on {self.device.type}: size it with --kv-cache-mib"
            )
        if self._forward is None:
            raise RuntimeError("the KV cache's budget before load()")
        lengths = profile_lengths(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.max_model_len)
        shape = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        kernels = self._decode_kernel, self._prefill_kernel
        peak = activation_peak_bytes(self._forward, lengths, shape, self.dtype, self.device, *kernels)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget_bytes(share, total, free, peak)  # gpu/cuda_memory.py
        log.info(
            "KV cache budget %.2f GiB: %s of %.1f GiB, %.2f GiB in use, a full step's activations %.2f GiB",
            budget / 2**30, share, total / 2**30, (total - free) / 2**30, peak / 2**30,
        )  # fmt: skip
        if budget < self.bytes_per_block:
            raise MemoryError(
                f"gpu_memory_utilization={share} of {total / 2**30:.1f} GiB leaves no room for the KV cache once the "
                f"model is loaded ({(total - free) / 2**30:.1f} GiB in use, {peak / 2**30:.2f} GiB for a full step's "
                "activations): raise it, or lower max_num_batched_tokens"
            )
        return budget

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * elem

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer, zeroed (padding reads must
        be finite). A compiled model is compiled here, on a dummy step.
        ``MemoryError`` naming the settings when the cache would take more
        than ``KV_MEMORY_SHARE`` of the device's memory available now (on the
        CPU, filling it would push the host into swap or the OOM killer)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1 (got {num_blocks})")
        capture = self._graph_capture()
        allocated = num_blocks + (capture is not None)  # and the graphs' scratch block, which no request gets
        need, available = allocated * self.bytes_per_block, available_memory(self.device)
        if need > KV_MEMORY_SHARE * available:
            raise MemoryError(
                f"the KV cache of {num_blocks} blocks needs {need / 2**20:.0f} MiB, more than "
                f"{KV_MEMORY_SHARE:.0%} of the {available / 2**20:.0f} MiB of {self.device.type} memory available "
                "now: lower kv_cache_memory_bytes (--kv-cache-mib) or num_kv_blocks"
            )
        shape = (self.num_layers, 2, allocated, self.block_size, self.num_kv_heads, self.head_dim)
        pool = torch.zeros(shape, dtype=self.dtype, device=self.device)  # one allocation
        self.kv_caches = [(pool[layer, 0], pool[layer, 1]) for layer in range(self.num_layers)]  # [N, bs, KVH, D]
        self.num_blocks = num_blocks
        if self.compiled:
            self._warm_up()
            pool.zero_()
        if capture is not None:
            self._capture_graphs(capture)

    def _graph_capture(self) -> Capture | None:
        """How decode steps are captured as graphs (None: they are not): on
        CUDA unless ``enforce_eager``, or eagerly anywhere with
        ``TRIOSERVE_DECODE_GRAPHS=eager``; for one rank's text generation
        without adapters, with a decode kernel."""
        alone = self.world_size == 1 and self.lora is None and self.pooler is None
        if self.config.enforce_eager or not alone or self._decode_kernel is None:
            return None
        mode = os.environ.get(GRAPHS_ENV, "cuda")
        if mode == "eager":
            return eager_capture
        if mode == "cuda" and self.device.type == "cuda":
            return cuda_capture(torch.cuda.graph_pool_handle())
        return None

    @torch.inference_mode()
    def _capture_graphs(self, capture: Capture) -> None:
        if self._forward is None or self._decode_kernel is None:
            raise RuntimeError("graphs before load()")
        width = -(-self.max_model_len // self.block_size)
        buckets = graph_buckets(self.config.max_num_seqs)
        self._graphs = DecodeGraphs(
            self._forward, self.kv_caches, self.block_size, width, self.num_blocks, self._decode_kernel, buckets,
            self.device,
        )  # fmt: skip
        self._graphs.capture_all(capture)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One dummy step (a 2-token prefill and a decode, in block 0), so that
        the model is compiled before the first request."""
        started = time.perf_counter()
        meta = self.metadata([2, 1], [2, 2], [[0, 0], [0, 0]])
        input_ids = torch.zeros(3, dtype=torch.long, device=self.device)
        keep = torch.tensor([1, 2], dtype=torch.long, device=self.device)
        if self._forward is None:
            raise RuntimeError("init_kv_cache() before load()")
        with step_metadata(meta):
            self._forward(input_ids[None], meta.positions[None], keep)
        self.compile_seconds = time.perf_counter() - started
        log.info("model compiled in %.1f s (cache: %s)", self.compile_seconds, inductor_cache_dir())

    def metadata(
        self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]]
    ) -> PagedAttentionMetadata:
        """The attention metadata of a packed batch (``attention.build_metadata``)."""
        return build_metadata(
            query_lens, context_lens, block_tables, self.block_size, self.kv_caches, self.device,
            decode_kernel=self._decode_kernel, prefill_kernel=self._prefill_kernel,
        )  # fmt: skip

    # --- control calls (between steps) -------------------------------------

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) and the weights too (level 2), giving
        the memory back to the system. The requests' state stays: the engine
        core sleeps only once none is running. Sleeping again only frees more."""
        self.kv_caches = []
        self._graphs = None  # they read the cache (and the weights): captured again on waking
        if level >= 2:
            # A compiled graph takes the weights as inputs: it holds none, and serves the reloaded model.
            self.model = self._forward = None
        self.sleep_level = max(self.sleep_level, level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()

    def wake_up(self) -> None:
        """Load what ``sleep`` freed: the weights (from the model directory,
        with the same process group) and a zeroed KV cache of the same size."""
        if self.model is None:
            self._load_model()
        if not self.kv_caches:
            self.init_kv_cache(self.num_blocks)
        self.sleep_level = 0

    def load_adapter(self, name: str, path: str) -> int:
        return self._adapters().load(name, path)

    def drop_adapter(self, name: str) -> None:
        self._adapters().drop(name)

    def pin_adapter(self, name: str) -> None:
        self._adapters().pin(name)

    def _adapters(self) -> LoraLayers:
        if self.lora is None:
            raise ValueError("LoRA adapters: this engine was started without enable_lora (--enable-lora)")
        return self.lora

    def describe(self) -> ShardInfo:
        """This rank's share of the weights and the KV cache, and its memory."""
        num_params, param_bytes = sharding.local_parameters(self.model) if self.model is not None else (0, 0)
        kv_bytes = self.bytes_per_block * self.num_blocks if self.kv_caches else 0
        device_bytes = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        return ShardInfo(
            engine_index=self.engine_index, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
            architecture=self.architecture, num_parameters=num_params, parameter_bytes=param_bytes,
            num_kv_heads=self.num_kv_heads, num_kv_blocks=self.num_blocks, kv_cache_bytes=kv_bytes,
            rss_bytes=resident_bytes(), device_memory_bytes=device_bytes, sleep_level=self.sleep_level,
        )  # fmt: skip

    # --- one step -----------------------------------------------------------

    def execute(self, sched: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None = None) -> RunnerOutput:
        """Run one step: update request state, one packed model call, then
        (for a step that awaits one, once ``bitmask()`` gives it) the grammar
        bitmask, and sample."""
        started = time.perf_counter()
        out = self._execute(sched, bitmask)
        if self._step_log is not None:
            self._log_step(sched, out, started)
        return out

    def _log_step(self, sched: SchedulerOutput, out: RunnerOutput, started: float) -> None:
        # A request with one token past its prompt has just sampled its first output token.
        first = sum(len(self.requests[r].token_ids) == self.requests[r].num_prompt_tokens + 1 for r in out.req_ids)
        record = StepRecord(
            started, time.perf_counter(), sched.total_num_scheduled_tokens,
            len(sched.num_scheduled_tokens), len(out.req_ids), first,
        )  # fmt: skip
        if self._step_log is not None:
            self._step_log.write(format_step(record))

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None) -> RunnerOutput:
        if is_dummy(sched):  # lockstep's step with nothing to compute: also while asleep, with its peers
            self._update_requests(sched)  # (it only forgets requests)
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        if self._forward is None or not self.kv_caches:
            raise RuntimeError("execute() before load() and init_kv_cache(), or while asleep")
        self._update_requests(sched)
        if not sched.num_scheduled_tokens:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        step = self._plan(sched)
        if self.lora is not None:  # the step's adapters in their slots, and each one's rows
            self.lora.prepare([(self.requests[r].params.lora, n) for r, n in sched.num_scheduled_tokens.items()])
        if self._encoder and self.pooler is not None:  # whole prompts, both ways, no KV cache
            hidden = encoder_hidden(self.model, step.input_ids, step.query_lens)  # type: ignore[arg-type]
            rows = torch.tensor(step.pooling.rows, dtype=torch.long, device=self.device)
            return RunnerOutput(req_ids=[], sampled_token_ids=[], pooled=self.pooler.pool(step.pooling, hidden[rows]))
        if self._graphs is not None and (decodes := self._graph_rows(step)) is not None:
            logits = self._graphs.run(decodes)  # [T, V], each row one sequence's
            if len(step.sample_rows) < len(decodes.input_ids):  # a 1-token prompt chunk short of its end
                logits = logits[torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)]
        else:
            meta = self.metadata(step.query_lens, step.context_lens, step.block_tables)
            input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)  # [T]
            keep = torch.tensor(
                step.sample_rows + step.prompt_logprobs.rows + step.pooling.rows, dtype=torch.long, device=self.device
            )  # [S + P], or the pooled rows [R]
            with step_metadata(meta):
                logits = self._forward(input_ids[None], meta.positions[None], keep)  # [1, T], [1, T], [S+P] -> [S+P, V]
        for req_id, n in sched.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        if self.pooler is not None:  # an embedding engine: the rows are hidden states, [R, H]
            return RunnerOutput(req_ids=[], sampled_token_ids=[], pooled=self.pooler.pool(step.pooling, logits))
        num_sampled = len(step.sample_rows)
        prompt_logprobs = step.prompt_logprobs.compute(logits[num_sampled:])
        logits = logits[:num_sampled]  # [S, V]
        if sched.awaits_bitmask:
            if bitmask is None:
                raise ValueError("a step that awaits a grammar bitmask, and no way to receive it")
            logits = apply_grammar_bitmask(logits, step.sample_req_ids, bitmask())
        if not step.sample_req_ids:
            return RunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        reqs = [self.requests[r] for r in step.sample_req_ids]
        batch = SamplingBatch(
            [r.params for r in reqs],
            [r.token_ids for r in reqs],
            [r.num_prompt_tokens for r in reqs],
            [r.processors for r in reqs] if any(r.processors is not None for r in reqs) else (),
        )
        out = sample(logits, batch, self.generator)
        for req, token_id in zip(reqs, out.token_ids, strict=True):
            req.token_ids.append(token_id)  # the next step computes it, whether or not the engine has it yet
            req.wants_prompt_logprobs = False
        return RunnerOutput(
            req_ids=step.sample_req_ids,
            sampled_token_ids=out.token_ids,
            logprobs=out.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _update_requests(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.pooler is not None:
                self.pooler.forget(req_id)
        for new in sched.new_requests:
            self._add_request(new)
        for cached in sched.cached_requests:
            self._update_request(cached)

    def _add_request(self, new: NewRequestData) -> None:
        _check_range(f"token_ids of {new.req_id!r}", new.token_ids, self.vocab_size)
        _check_range(f"block_ids of {new.req_id!r}", new.block_ids, self.num_blocks)
        params = new.params
        if (params.pooling is not None) != (self.pooler is not None):
            task = "an embedding" if params.pooling is not None else "a generation"
            raise ValueError(f"new_requests: {new.req_id!r} is {task} request, which this model does not serve")
        if self.pooler is not None:
            self.pooler.forget(new.req_id)  # preempted: its prompt is computed again
        self.requests[new.req_id] = _Request(
            params=params,
            token_ids=list(new.token_ids),
            block_ids=list(new.block_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed_tokens=new.num_computed_tokens,
            processors=RowProcessors.build(params, self.eos_token_ids, self.vocab_size, self.device),
            wants_prompt_logprobs=params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens,
        )

    def _update_request(self, cached: CachedRequestData) -> None:
        req = self.requests.get(cached.req_id)
        if req is None:
            raise ValueError(f"cached_requests: unknown request {cached.req_id!r}")
        _check_range(f"new_block_ids of {cached.req_id!r}", cached.new_block_ids, self.num_blocks)
        req.block_ids.extend(cached.new_block_ids)
        req.num_computed_tokens = cached.num_computed_tokens

    def _plan(self, sched: SchedulerOutput) -> _Step:
        step = _Step([], [], [], [], [], [])
        for req_id, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:
                raise ValueError(f"num_scheduled_tokens: unknown request {req_id!r}")
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            if n < 1 or end > len(req.token_ids):
                raise ValueError(
                    f"num_scheduled_tokens[{req_id!r}]: {n} tokens from {start} overrun {len(req.token_ids)}"
                )
            if end > len(req.block_ids) * self.block_size:
                raise ValueError(f"block_ids of {req_id!r}: {len(req.block_ids)} blocks cannot hold {end} tokens")
            step.input_ids.extend(req.token_ids[start:end])
            step.query_lens.append(n)
            step.context_lens.append(end)
            step.block_tables.append(req.block_ids)
            if req.params.pooling is not None:
                step.pooling.add(req_id, req.params.pooling, start, end, req.num_prompt_tokens, len(step.input_ids) - n)
                continue
            if req.wants_prompt_logprobs:
                top_n, packed_at = req.params.prompt_logprobs or 0, len(step.input_ids) - n
                step.prompt_logprobs.add(req_id, req.token_ids, req.num_prompt_tokens, top_n, start, end, packed_at)
            if end == len(req.token_ids):
                step.sample_rows.append(len(step.input_ids) - 1)
                step.sample_req_ids.append(req_id)
        return step

    def _graph_rows(self, step: _Step) -> DecodeRows | None:
        """The step as rows for the decode graphs: every sequence one token,
        no prompt logprobs or pooling, within the graphs' sizes (else None)."""
        if max(step.query_lens) > 1 or step.prompt_logprobs.rows or step.pooling.rows or self._graphs is None:
            return None
        rows = DecodeRows(step.input_ids, step.context_lens, step.block_tables)
        return rows if self._graphs.covers(rows) else None


def _check_range(what: str, ids: list[int], upper: int) -> None:
    """Out-of-range ids would crash the device (CUDA asserts): refuse them here."""
    if ids and not 0 <= min(ids) <= max(ids) < upper:
        raise ValueError(f"{what}: must be in [0, {upper})")
