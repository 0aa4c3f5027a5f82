"""ModelRunner driven in-process with hand-built SchedulerOutputs, against
transformers' own greedy generate() on the same weights."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import pytest
from helpers.reference import reference_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.config import EngineConfig
from trioserve.messages import (
    CachedRequestData,
    ModelInfo,
    NewRequestData,
    RunnerOutput,
    SampleLogprobs,
    SchedulerOutput,
)
from trioserve.sampling_params import SamplingParams

torch = pytest.importorskip("torch")

from trioserve.gpu.cpu_kernels.attention import CPU_ATTENTION_ENV  # noqa: E402
from trioserve.gpu.cpu_kernels.linear import PACKED_LINEAR_ENV  # noqa: E402

pytestmark = pytest.mark.model

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma2"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@dataclass
class Seq:
    tokens: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)  # of the outputs sampled here
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False  # the runner holds this request's state
    new_blocks: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.outputs) >= self.params.max_tokens

    @property
    def num_prompt(self) -> int:
        return len(self.tokens) - len(self.outputs)


class MiniScheduler:
    """Just enough of a scheduler to drive the runner: shuffled block
    allocation, a token budget per step (so long prompts are chunked), and
    preemption (the request is dropped and later re-sent with all tokens)."""

    def __init__(self, runner, *, num_blocks: int, block_size: int, token_budget: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = block_size
        self.token_budget = token_budget
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous tables
        self.seqs: dict[str, Seq] = {}
        self.dropped: list[str] = []

    def add(self, req_id: str, prompt: list[int], params: SamplingParams = GREEDY, outputs: Sequence[int] = ()) -> None:
        """``outputs``: a continuation's tokens so far (sent as output, after the prompt)."""
        self.seqs[req_id] = Seq([*prompt, *outputs], params, list(outputs))

    def preempt(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        self.free.extend(seq.blocks)
        seq.blocks, seq.num_computed, seq.sent, seq.new_blocks = [], 0, False, []
        self.dropped.append(req_id)

    def _allocate(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < num_tokens:
            block = self.free.pop()
            seq.blocks.append(block)
            seq.new_blocks.append(block)

    def step(self) -> RunnerOutput:
        new, cached, scheduled = [], [], {}
        budget = self.token_budget
        for req_id, seq in self.seqs.items():
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if seq.finished or n <= 0:
                continue
            budget -= n
            scheduled[req_id] = n
            self._allocate(seq, seq.num_computed + n)
            if seq.sent:
                cached.append(CachedRequestData(req_id, seq.new_blocks, seq.num_computed))
            else:
                new.append(
                    NewRequestData(
                        req_id, list(seq.tokens), seq.params, list(seq.blocks), seq.num_computed, seq.num_prompt
                    )
                )
            seq.sent, seq.new_blocks = True, []
        sched = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), self.dropped)
        self.dropped = []
        out = self.runner.execute(sched)
        for req_id, n in scheduled.items():
            self.seqs[req_id].num_computed += n
        logprobs = out.logprobs or [None] * len(out.req_ids)
        for req_id, token, lp in zip(out.req_ids, out.sampled_token_ids, logprobs, strict=True):
            seq = self.seqs[req_id]
            seq.tokens.append(token)
            seq.outputs.append(token)  # the runner appended it to its own copy
            seq.logprobs.append(lp)
            if seq.finished:
                self.free.extend(seq.blocks)
                self.dropped.append(req_id)
        return out

    def run(self, preempt_at: dict[int, str] | None = None, max_steps: int = 200) -> dict[str, list[int]]:
        for step in range(max_steps):
            if all(seq.finished for seq in self.seqs.values()):
                return {req_id: seq.outputs for req_id, seq in self.seqs.items()}
            if preempt_at and step in preempt_at:
                self.preempt(preempt_at[step])
            self.step()
        raise AssertionError("requests did not finish")


def make_runner(model_dir, *, num_blocks: int = 128, block_size: int = 4, **config):
    from trioserve.gpu.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(model_dir), block_size=block_size, num_kv_blocks=num_blocks, **config))
    loaded = runner.load()
    runner.init_kv_cache(loaded.max_num_kv_blocks)
    return runner, loaded


def make_prompts(lengths: list[int], seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(n - 1)] for n in lengths]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_chunked_and_preempted_batch_matches_generate(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 23, 41, 2])
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir)
    # 24 tokens a step: the 23- and 41-token prompts are split across steps,
    # and decodes share steps with prefill chunks.
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=24)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    # r1 is preempted after some output tokens; r2 in the middle of its prefill.
    outputs = sched.run(preempt_at={2: "r2", 6: "r1"})
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_decodes_split_into_several_groups_match_generate(tiny_model_dir, arch, monkeypatch):
    # The portable path (the CPU kernel attends every decode in one call).
    # The tiny models' blocks are small enough that every decode shares one
    # group; a budget of 12 blocks per group splits this batch into several.
    from trioserve.gpu import attention
    from trioserve.gpu.cpu_kernels.attention import CPU_ATTENTION_ENV

    monkeypatch.setenv(CPU_ATTENTION_ENV, "0")

    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 23, 41, 2, 14, 30], seed=11)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir)
    k_block = runner.kv_caches[0][0][0]
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 12 * k_block.numel() * k_block.element_size())
    group_counts = []
    group_decodes = attention._group_decodes

    def counting(*args):
        groups = group_decodes(*args)
        group_counts.append(len(groups))
        return groups

    monkeypatch.setattr(attention, "_group_decodes", counting)
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=128)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    outputs = sched.run()
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert max(group_counts) >= 3


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: windows and softcaps through the op
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
def test_compiled_model_matches_generate_in_one_graph(tiny_model_dir, arch):
    """The compiled model (gpu/compiled.py), compiled while the KV cache is
    set up, then never again: steps with no sampled row, one token, prefill
    chunks beside decodes, a preemption, and the model reloaded after a
    deep sleep all run the same graph."""
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([41, 5, 23, 2])
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir, compile=True)  # compiles here, on a dummy step
    assert runner.compile_seconds > 0
    assert runner._decode_kernel is not None  # decodes read the cache in place (gpu/cpu_kernels/attention.py)
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=24)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert sched.step().req_ids == []  # 24 of r0's 41 tokens: nothing sampled
        outputs = sched.run(preempt_at={4: "r2"})  # ... down to r0 decoding alone: one token
        assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
        runner.sleep(2)  # the weights freed, then loaded again: the same graph serves them
        runner.wake_up()
        again = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=24)
        again.add("r0", prompts[0])
        assert again.run()["r0"] == expected[0]


def test_step_log_has_a_line_per_step(tiny_model_dir, tmp_path, monkeypatch):
    from trioserve.runners.steplog import STEP_LOG_ENV, read_step_log

    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps"))
    runner, _ = make_runner(tiny_model_dir("llama"))
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=8)
    sched.add("a", make_prompts([12])[0])  # two prefill chunks, then the first token
    sched.add("b", make_prompts([3])[0])
    for _ in range(4):
        sched.step()
    steps = read_step_log(tmp_path / "steps.0")
    assert [(s.num_tokens, s.num_seqs, s.num_sampled, s.num_first) for s in steps] == [
        (8, 1, 0, 0),  # a: 8 of 12 prompt tokens
        (7, 2, 2, 2),  # a: the last 4, b: its 3; both sample their first token
        (2, 2, 2, 0),  # decodes
        (2, 2, 2, 0),
    ]
    assert all(0 < s.seconds < 60 for s in steps)
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(steps))


def test_requests_added_while_others_decode_match_generate(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts([9, 3, 30], seed=7)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir, block_size=16)
    sched = MiniScheduler(runner, num_blocks=128, block_size=16, token_budget=64)
    sched.add("a", prompts[0])
    for _ in range(3):
        sched.step()
    sched.add("b", prompts[1])
    sched.step()
    sched.add("c", prompts[2])
    outputs = sched.run()
    assert [outputs[k] for k in "abc"] == expected


def test_prefill_chunks_short_of_the_end_sample_nothing(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompt = make_prompts([20], seed=5)[0]
    runner, _ = make_runner(model_dir)
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=8)
    sched.add("a", prompt)
    assert [sched.step().req_ids for _ in range(3)] == [[], [], ["a"]]
    assert sched.run()["a"] == reference_greedy(model_dir, [prompt], GREEDY.max_tokens)[0]


def test_seeded_sampling_does_not_depend_on_batch_or_preemption(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    prompt = make_prompts([11], seed=3)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=8)

    def run(with_others: bool, preempt: bool) -> list[int]:
        runner, _ = make_runner(model_dir)
        sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=16)
        if with_others:
            for i, other in enumerate(make_prompts([7, 19], seed=9)):
                sched.add(f"other{i}", other, SamplingParams(temperature=1.0, max_tokens=8))
        sched.add("seeded", prompt, params)
        return sched.run(preempt_at={4: "seeded"} if preempt else None)["seeded"]

    alone = run(with_others=False, preempt=False)
    assert run(with_others=True, preempt=True) == alone
    assert len(set(alone)) > 1


def test_penalties_count_only_output_tokens_also_after_preemption(tiny_model_dir):
    # Frequency and presence penalties cover output tokens only: a request
    # resumed after preemption (re-sent with its outputs) must not count its
    # earlier outputs as prompt.
    model_dir = tiny_model_dir("llama")
    prompt = make_prompts([9], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=2.0)

    def run(preempt: bool) -> list[int]:
        runner, _ = make_runner(model_dir)
        sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=16)
        sched.add("r", prompt, params)
        return sched.run(preempt_at={2: "r"} if preempt else None)["r"]

    # (Counting them as prompt, this model repeats its second token at once.)
    assert run(preempt=True) == run(preempt=False)


CONTINUED = [  # greedy and seeded, with every penalty, min_tokens and logprobs
    SamplingParams(
        temperature=0, max_tokens=10, min_tokens=4, repetition_penalty=1.3, frequency_penalty=0.5,
        presence_penalty=0.3, logprobs=3,
    ),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, min_tokens=3, frequency_penalty=0.5, logprobs=2),
]  # fmt: skip


@pytest.fixture(scope="module")
def continued_runner(tiny_model_dir):
    return make_runner(tiny_model_dir("qwen3"))[0]


@settings(max_examples=12, deadline=None)
@given(variant=st.sampled_from(range(len(CONTINUED))), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_a_request_continued_from_any_token_samples_what_it_would_have(continued_runner, variant, seed, data):
    """A continuation (a request resumed elsewhere: the runner gets its
    prompt and its tokens so far as output, in a batch of its own) samples
    the tokens the undisturbed request did, with their logprobs: penalties
    and min_tokens count its earlier tokens as output, and a seeded draw is
    a function of the seed and the token's position alone."""
    params = msgspec.structs.replace(CONTINUED[variant], seed=None if variant == 0 else seed)
    prompt = make_prompts([9], seed=seed % 1000)[0]
    names = itertools.count()

    def run(outputs: list[int], with_others: bool) -> tuple[list[int], list[SampleLogprobs | None]]:
        sched = MiniScheduler(continued_runner, num_blocks=128, block_size=4, token_budget=16, seed=len(outputs))
        if with_others:
            for other in make_prompts([7, 12], seed=5):
                sched.add(f"other-{next(names)}", other, SamplingParams(temperature=1.0, max_tokens=10))
        req_id = f"r-{next(names)}"
        sched.add(req_id, prompt, params, outputs)
        sched.run()
        seq = sched.seqs[req_id]
        sched.dropped.extend(sched.seqs)  # the runner forgets them all
        sched.step()
        return seq.outputs, seq.logprobs

    tokens, logprobs = run([], with_others=True)
    k = data.draw(st.integers(1, len(tokens) - 1), label="resumed after")
    resumed, resumed_logprobs = run(tokens[:k], with_others=False)
    assert resumed == tokens
    for got, expected in zip(resumed_logprobs, logprobs[k:], strict=True):
        assert got is not None and expected is not None
        assert (got.top_token_ids, got.rank) == (expected.top_token_ids, expected.rank)
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)


def test_load_reports_memory_budget_eos_and_context(tiny_model_dir):
    from trioserve.gpu.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model_dir("llama")), block_size=16, kv_cache_memory_bytes=10 * 2**20)
    loaded = ModelRunner(config).load()
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # K and V, layers, KV heads, head dim, block size, float32
    assert loaded.max_num_kv_blocks == 10 * 2**20 // per_block
    assert loaded.model == ModelInfo(vocab_size=259, max_model_len=512, eos_token_ids=[2], hidden_size=64)
    assert ModelRunner(config.replace(max_model_len=100, num_kv_blocks=7)).load().max_num_kv_blocks == 7


def test_a_model_whose_context_holds_one_token_is_refused_at_load_naming_config_json(tiny_model_dir, tmp_path):
    """Found: the engine core refused it after the load, and the operator's
    last line said only that the engine core exited with code 1."""
    from trioserve.gpu.model_runner import ModelRunner
    from trioserve.gpu.tiny_models import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", "llama", max_position_embeddings=1)
    with pytest.raises(ValueError, match=r"config.json's max_position_embeddings is 1: a model's context must hold"):
        ModelRunner(EngineConfig(model=str(model_dir))).load()


def test_a_max_model_len_beyond_the_models_positions_is_refused_at_load(tiny_model_dir):
    """Found: accepted, and a long prompt then took the worker down (learned
    positions index out of range): each such request killed the engine."""
    from trioserve.gpu.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=513)
    with pytest.raises(ValueError, match=r"^max_model_len: 513 is more than this model's context, 512 tokens"):
        ModelRunner(config).load()
    assert ModelRunner(config.replace(max_model_len=512)).load().model.max_model_len == 512


def test_a_kv_cache_larger_than_the_memory_available_is_refused_before_it_is_allocated(tiny_model_dir, monkeypatch):
    """Found: --kv-cache-mib 12000 zero-filled 8+ GiB of this 24 GiB host (40000: the OOM killer)."""
    from trioserve.gpu import model_runner

    runner = model_runner.ModelRunner(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4))
    runner.load()
    available = 64 * runner.bytes_per_block
    monkeypatch.setattr(model_runner, "available_memory", lambda device: available)
    with pytest.raises(
        MemoryError, match=r"the KV cache of 64 blocks needs .* more than 90% of the .* MiB of cpu memory"
    ):
        runner.init_kv_cache(64)
    assert runner.kv_caches == []  # nothing allocated
    runner.init_kv_cache(57)  # within 90%
    assert runner.num_blocks == 57


def test_logprobs_and_bfloat16_run_end_to_end(tiny_model_dir):
    runner, _ = make_runner(tiny_model_dir("gemma2"), dtype="bfloat16")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=32)
    sched.add("a", make_prompts([6])[0], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    out = sched.step()
    assert out.req_ids == ["a"] and len(out.logprobs) == 1
    assert len(out.logprobs[0].top_token_ids) == 2 and out.logprobs[0].top_token_ids[0] == out.sampled_token_ids[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_greedy_matches_generate_at_bfloat16(tiny_model_dir, arch, monkeypatch):
    """Exact with the portable attention and ``F.linear`` (SDPA and MKL at
    bfloat16, as transformers runs them). Our CPU kernels, on by default at
    bfloat16 (the decode attention; the GEMM where oneDNN has no native
    bfloat16), compute in float32 and round once, so their tokens part from
    transformers' where logits nearly tie: their agreement is measured by
    scripts/bf16_agreement.py (docs/benchmarks.md), their results checked in
    tests/test_gpu_attention.py and tests/test_gpu_cpu_linear.py."""
    monkeypatch.setenv(CPU_ATTENTION_ENV, "0")
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 23, 41, 2], seed=7)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens, dtype=torch.bfloat16)
    runner, _ = make_runner(model_dir, dtype="bfloat16")
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=24)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    outputs = sched.run()
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected


def test_bad_scheduler_output_raises_value_error(tiny_model_dir):
    runner, _ = make_runner(tiny_model_dir("llama"), num_blocks=8)

    def step(new=(), scheduled=None) -> RunnerOutput:
        return runner.execute(SchedulerOutput(list(new), [], scheduled or {}, 0, []))

    with pytest.raises(ValueError, match="token_ids"):
        step([NewRequestData("x", [1, 9999], GREEDY, [0], 0, 2)], {"x": 2})
    with pytest.raises(ValueError, match="block_ids"):
        step([NewRequestData("y", [1, 5], GREEDY, [8], 0, 2)], {"y": 2})
    with pytest.raises(ValueError, match="unknown request"):
        step(scheduled={"nobody": 1})
    with pytest.raises(ValueError, match="cannot hold"):
        step([NewRequestData("z", [1] * 6, GREEDY, [0], 0, 6)], {"z": 6})
    assert step().req_ids == []
