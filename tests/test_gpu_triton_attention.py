"""The Triton paged-attention kernels against the portable path (gpu/attention.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

# Without a CUDA device Triton's interpreter runs the kernels (numpy, on the CPU). It is chosen when a
# kernel is decorated, so this must be set before trioserve.gpu.triton_attention is imported.
INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402, F401  (the `triton` extra: scripts/setup.sh installs it, so these tests always run)
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trioserve.gpu.attention import build_metadata, paged_attention, step_metadata  # noqa: E402
from trioserve.gpu.triton_attention import decode_attention, prefill_attention  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
PAD_ROWS = 2  # rows of query and out past the batch's tokens: never written
SENTINEL = 123.0  # what out holds before a kernel runs


@dataclass(frozen=True)
class Case:
    """A packed batch over a paged cache; sequence i has query_lens[i] new tokens, the last of its context_lens[i]."""

    block_size: int
    heads: int
    kv_heads: int
    head_dim: int
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    window: int | None
    softcap: float | None
    block_order: tuple[int, ...]  # the pool's blocks, in the order the block tables take them
    seed: int = 0

    def tables(self) -> list[list[int]]:
        blocks = iter(self.block_order)
        return [[next(blocks) for _ in range(-(-c // self.block_size))] for c in self.context_lens]


@dataclass(frozen=True)
class Batch:
    """A case's tensors, and the portable path's output for it."""

    query: torch.Tensor  # [1, H, T + PAD_ROWS, D], a transposed view as the model passes it
    k_cache: torch.Tensor  # [N, bs, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, nb] long, 0-padded
    query_starts: torch.Tensor  # [S] long
    expected: torch.Tensor  # [T, H, D]


def make_batch(case: Case, dtype: torch.dtype = torch.float32) -> Batch:
    """Random cache and queries (float32, then cast to dtype); expected is the portable path's float32 output."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (len(case.block_order), case.block_size, case.kv_heads, case.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tokens = sum(case.query_lens)
    query = torch.randn(1, tokens + PAD_ROWS, case.heads, case.head_dim, generator=gen).transpose(1, 2)
    tables = case.tables()
    meta = build_metadata(
        list(case.query_lens), list(case.context_lens), tables, case.block_size, [(k_cache, v_cache)],
        torch.device("cpu"), decode_group_blocks=None, decode_kernel=None,
    )  # fmt: skip
    # The step's new K/V are already in the cache (written there above): the portable path writes them again.
    key = k_cache.view(-1, case.kv_heads, case.head_dim)[meta.slot_mapping].transpose(0, 1)[None]  # [1, KVH, T, D]
    value = v_cache.view(-1, case.kv_heads, case.head_dim)[meta.slot_mapping].transpose(0, 1)[None]
    with step_metadata(meta):
        expected = paged_attention(query[:, :, :tokens], key, value, 0, scale(case), case.window, case.softcap)
    width = max(len(t) for t in tables)
    starts = [sum(case.query_lens[:i]) for i in range(len(case.query_lens))]
    return Batch(
        query=query.to(DEVICE, dtype),
        k_cache=k_cache.to(DEVICE, dtype),
        v_cache=v_cache.to(DEVICE, dtype),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE),
        query_starts=torch.tensor(starts, device=DEVICE),
        expected=expected,
    )


def scale(case: Case) -> float:
    return case.head_dim**-0.5


def new_out(batch: Batch) -> torch.Tensor:
    _, heads, rows, head_dim = batch.query.shape
    return torch.full((rows, heads, head_dim), SENTINEL, dtype=batch.query.dtype, device=DEVICE)


def run_decode(case: Case, batch: Batch) -> tuple[torch.Tensor, list[int]]:
    """The decode kernel over the case's one-token sequences: -> (out, the rows it should write)."""
    decodes = [i for i, n in enumerate(case.query_lens) if n == 1]
    index = torch.tensor(decodes, device=DEVICE)
    # The block tables of the decodes only, cut to the longest one's blocks (0-padded), as build_metadata does.
    width = max(-(-case.context_lens[i] // case.block_size) for i in decodes)
    out = new_out(batch)
    token_index = batch.query_starts[index]
    decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables[index, :width].contiguous(),
        torch.tensor([case.context_lens[i] for i in decodes], device=DEVICE), token_index, out,
        scale(case), case.window, case.softcap, 0,
    )  # fmt: skip
    return out, token_index.tolist()


def run_prefill(case: Case, batch: Batch, extra_programs: int = 0) -> torch.Tensor:
    """The prefill kernel over every sequence of the case (one-token ones too) in one launch."""
    out = new_out(batch)
    prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.query_starts,
        torch.tensor(case.query_lens, device=DEVICE), torch.tensor(case.context_lens, device=DEVICE),
        batch.block_tables, out, scale(case), case.window, case.softcap, max(case.query_lens) + extra_programs,
    )  # fmt: skip
    return out


def assert_untouched(out: torch.Tensor, written: list[int]) -> None:
    others = [r for r in range(out.shape[0]) if r not in set(written)]
    assert others, "the case leaves no row unwritten"
    assert torch.equal(out[others].cpu(), torch.full_like(out[others].cpu(), SENTINEL))


@st.composite
def cases(draw: st.DrawFn, decode: bool) -> Case:
    """Block sizes 1-16, GQA groups 1-8, head dims with and without a power of two, contexts on, across and
    off block boundaries; decode cases: 1-4 one-token sequences among 0-2 prefills (whose rows the decode kernel
    must not touch); prefill cases: 1-4 sequences of any query length, chunks among them."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([8, 24, 64]))
    near_boundary = st.builds(lambda n, d: max(1, n * block_size + d), st.integers(1, 4), st.integers(-1, 1))
    context_len = st.one_of(st.integers(1, 40), near_boundary)
    if decode:
        seqs = [(draw(context_len), 1) for _ in range(draw(st.integers(1, 4)))]
        for _ in range(draw(st.integers(0, 2))):
            n = max(2, draw(context_len))
            seqs.append((n, draw(st.integers(2, n))))
        seqs = draw(st.permutations(seqs))
    else:
        seqs = []
        for _ in range(draw(st.integers(1, 4))):
            n = draw(context_len)
            seqs.append((n, draw(st.integers(1, n))))
    context_lens = tuple(c for c, _ in seqs)
    pool = sum(-(-c // block_size) for c in context_lens) + draw(st.integers(0, 3))
    return Case(
        block_size=block_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_lens=context_lens,
        query_lens=tuple(q for _, q in seqs),
        window=draw(st.none() | st.integers(1, 8)),
        softcap=draw(st.sampled_from([None, 30.0, 2.0])),
        block_order=tuple(draw(st.permutations(range(pool)))),
        seed=draw(st.integers(0, 2**16)),
    )


def shuffled_pool(size: int, seed: int = 1) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(size, generator=gen).tolist())


# Three decodes at lengths on and across block boundaries (16: 4 blocks of 4 exactly), beside a prefill of 5
# tokens whose rows the decode kernel must leave untouched.
DECODES = Case(4, 8, 2, 24, (16, 5, 17, 9), (1, 5, 1, 1), None, None, shuffled_pool(15))
# A fresh prefill, two chunks with earlier context (one a single token) and a window with softcap.
PREFILLS = Case(4, 8, 2, 24, (12, 30, 9, 7), (12, 7, 1, 4), 6, 30.0, shuffled_pool(20))


@settings(max_examples=50, deadline=None)
@example(case=DECODES)
@example(case=Case(1, 4, 4, 64, (3, 1, 2), (1, 1, 1), 2, 2.0, shuffled_pool(8)))
@example(case=Case(8, 4, 1, 200, (40, 3), (1, 1), None, 30.0, shuffled_pool(7)))  # head dim > 128: narrower tiles
@given(case=cases(decode=True))
def test_decode_matches_portable_path(case: Case) -> None:
    batch = make_batch(case)
    out, written = run_decode(case, batch)
    torch.testing.assert_close(out[written].cpu(), batch.expected[written], rtol=1e-4, atol=1e-5)
    assert_untouched(out, written)


@settings(max_examples=50, deadline=None)
@example(case=PREFILLS, extra_programs=0)
@example(case=Case(16, 2, 1, 8, (33, 17), (2, 17), None, 2.0, shuffled_pool(5)), extra_programs=1)
@example(case=Case(2, 2, 1, 200, (37, 20), (35, 20), 9, None, shuffled_pool(30)), extra_programs=0)  # head dim > 128
@given(case=cases(decode=False), extra_programs=st.integers(0, 2))
def test_prefill_matches_portable_path(case: Case, extra_programs: int) -> None:
    batch = make_batch(case)
    out = run_prefill(case, batch, extra_programs)
    tokens = sum(case.query_lens)
    torch.testing.assert_close(out[:tokens].cpu(), batch.expected, rtol=1e-4, atol=1e-5)
    assert_untouched(out, list(range(tokens)))  # the padding rows, past every sequence's queries


HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_half_precision_inputs_match_float32(dtype: torch.dtype, kernel: str) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        # Triton's interpreter stores bfloat16 as uint16 and its tl.dot multiplies those raw bits as integers
        # (triton 3.9, InterpreterBuilder.create_dot): garbage, not the kernel's doing. A GPU runs this case.
        pytest.skip("Triton's interpreter cannot run tl.dot on bfloat16")
    case = DECODES if kernel == "decode" else PREFILLS
    batch = make_batch(case, dtype)
    if kernel == "decode":
        out, written = run_decode(case, batch)
    else:
        out, written = run_prefill(case, batch), list(range(sum(case.query_lens)))
    assert out.dtype == dtype
    tol = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(out[written].cpu().float(), batch.expected[written], rtol=tol, atol=tol)
    assert_untouched(out, written)


# Compiles the kernel for an H100/H200 (sm_90) down to a cubin with the toolchain in the triton wheel: no GPU
# needed, and it catches what the interpreter lets through (tl.dot shapes, types across loops and branches).
COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from trioserve.gpu.triton_attention import _paged_attention_kernel as kernel, _Tiles

def signature(dtype):
    pointers = {"query": dtype, "k_cache": dtype, "v_cache": dtype, "out": dtype}
    return {
        n: "constexpr" if n.isupper() else "fp32" if n in ("scale", "softcap")
        else f"*{pointers.get(n, 'i64')}" if not n.startswith("stride_") and n != "window" else "i32"
        for n in kernel.arg_names
    }

for dtype, group, head_dim, decode, window in [("bf16", 8, 128, True, True), ("fp16", 4, 256, False, False)]:
    tiles = _Tiles.choose(group, head_dim, decode)
    constants = dict(
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=16, BLOCK_Q=tiles.block_q, GROUP_PAD=tiles.group_pad,
        BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n, IS_DECODE=decode, HAS_WINDOW=window, HAS_SOFTCAP=True,
    )
    source = triton.compiler.ASTSource(fn=kernel, signature=signature(dtype), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles.num_warps})
    print(dtype, decode, len(compiled.asm["cubin"]))
"""


def test_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split()
    assert [lines[0], lines[3]] == ["bf16", "fp16"] and int(lines[2]) > 0 and int(lines[5]) > 0


@pytest.mark.model
@pytest.mark.parametrize("arch", ["gemma2"])  # windows and softcaps too
def test_a_runner_attending_with_these_kernels_gives_generates_greedy_tokens(tiny_model_dir, arch, monkeypatch):
    """The kernels where the CUDA path puts them (``attention_kernels``): every
    prefill (and chunk) of a step in one call, decodes through the decode
    graphs' padded buffers (``TRIOSERVE_DECODE_GRAPHS=eager``), with a preemption."""
    from helpers.reference import reference_greedy

    from test_gpu_runner import GREEDY, MiniScheduler, make_prompts, make_runner
    from trioserve.gpu import model_runner
    from trioserve.gpu.decode_graphs import GRAPHS_ENV

    monkeypatch.setenv(GRAPHS_ENV, "eager")
    monkeypatch.setattr(model_runner, "attention_kernels", lambda device, dtype: (decode_attention, prefill_attention))
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 19, 2, 11], seed=3)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir, num_blocks=64, max_num_seqs=4)
    assert runner._prefill_kernel is prefill_attention and runner._graphs is not None
    sched = MiniScheduler(runner, num_blocks=64, block_size=4, token_budget=16)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    outputs = sched.run(preempt_at={5: "r1"})
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
