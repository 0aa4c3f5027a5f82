"""The paged attention function alone, against plain per-sequence attention."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from trioserve.gpu.attention import build_metadata, paged_attention_forward, step_metadata  # noqa: E402

H, KVH, D, BLOCK = 4, 2, 8, 4


def reference(q, k, v, scale, window=None, softcap=None):
    """Causal attention of one whole sequence: q [H, L, D], k/v [KVH, L, D] -> [L, H, D]."""
    k = k.repeat_interleave(H // KVH, dim=0)
    v = v.repeat_interleave(H // KVH, dim=0)
    scores = q @ k.transpose(1, 2) * scale  # [H, L, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(q.shape[1])
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_steps(
    seqs, steps, scale, window, softcap, scale_from_module, num_blocks=64, decode_group_blocks=None, decode_kernel=None
):
    """Feed each sequence's q/k/v through the paged function, ``steps`` giving
    per step the number of new tokens of each sequence (0: not scheduled)."""
    d, dtype = seqs[0]["q"].shape[-1], seqs[0]["q"].dtype
    caches = [
        (torch.zeros(num_blocks, BLOCK, KVH, d, dtype=dtype), torch.zeros(num_blocks, BLOCK, KVH, d, dtype=dtype))
    ]
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s["q"].shape[1] / BLOCK))] for s in seqs]
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    module = SimpleNamespace(layer_idx=0, scaling=scale)
    for counts in steps:
        active = [i for i, n in enumerate(counts) if n]
        rows = [slice(done[i], done[i] + counts[i]) for i in active]
        q = torch.cat([seqs[i]["q"][:, r] for i, r in zip(active, rows, strict=True)], dim=1)[None]  # [1, H, T, D]
        k = torch.cat([seqs[i]["k"][:, r] for i, r in zip(active, rows, strict=True)], dim=1)[None]  # [1, KVH, T, D]
        v = torch.cat([seqs[i]["v"][:, r] for i, r in zip(active, rows, strict=True)], dim=1)[None]
        meta = build_metadata(
            [counts[i] for i in active], [done[i] + counts[i] for i in active], [tables[i] for i in active],
            BLOCK, caches, torch.device("cpu"), decode_group_blocks, decode_kernel,
        )  # fmt: skip
        with step_metadata(meta):
            out, _ = paged_attention_forward(
                module,
                q,
                k,
                v,
                None,
                scaling=None if scale_from_module else scale,
                sliding_window=window,
                softcap=softcap,
            )
        start = 0
        for i in active:
            outs[i].append(out[0, start : start + counts[i]])
            start += counts[i]
            done[i] += counts[i]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize(
    ("window", "softcap", "scale_from_module"),
    [(None, None, False), (5, None, False), (None, 2.0, False), (3, 1.5, False), (None, None, True)],
)
def test_prefill_chunks_and_decodes_match_per_sequence_attention(window, softcap, scale_from_module):
    gen = torch.Generator().manual_seed(0)
    decodes = 4
    lengths = [9 + decodes, 14 + decodes, 3 + decodes]
    seqs = [
        {name: torch.randn(heads, n, D, generator=gen) for name, heads in (("q", H), ("k", KVH), ("v", KVH))}
        for n in lengths
    ]
    steps = [
        [6, 10, 3],  # prefills; seqs 0 and 1 are chunked
        [3, 0, 0],  # the rest of seq 0: a chunk with earlier context
        [0, 1, 0],  # a one-token chunk of seq 1
        [0, 3, 0],
    ] + [[1, 1, 1]] * decodes  # decodes at three different context lengths
    scale = 0.3
    got = run_steps(seqs, steps, scale, window, softcap, scale_from_module)
    for seq, out in zip(seqs, got, strict=True):
        torch.testing.assert_close(out, reference(seq["q"], seq["k"], seq["v"], scale, window, softcap))


@pytest.fixture(scope="module", params=["host", "avx2"])
def decode_kernel(request):
    """The kernel built for this host's vector ISA, and for AVX2's 256-bit vectors (where the host has them)."""
    from trioserve.gpu.cpu_kernels.attention import CpuDecodeKernel, load_decode_kernel

    if request.param == "host":
        kernel = load_decode_kernel(torch.device("cpu"), torch.float32)
        assert kernel is not None
        return kernel
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 host with AVX2 (this one: {torch.backends.cpu.get_cpu_capability()})")
    return CpuDecodeKernel(torch.float32, simdlen=256)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
@pytest.mark.parametrize(
    ("window", "softcap", "head_dim"), [(None, None, 8), (5, None, 8), (None, 2.0, 8), (3, 1.5, 8), (None, None, 44)]
)
def test_decode_kernel_matches_per_sequence_attention(decode_kernel, window, softcap, head_dim):
    """The CPU kernel reading the cache in place (gpu/cpu_kernels/attention.py), at
    an odd head size too (the vector loops' tails)."""
    seqs, steps = prefills_then_decodes(2, (2, 13, 7, 21), 4, head_dim)
    got = run_steps(seqs, steps, 0.3, window, softcap, False, decode_kernel=decode_kernel)
    for seq, out in zip(seqs, got, strict=True):
        torch.testing.assert_close(out, reference(seq["q"], seq["k"], seq["v"], 0.3, window, softcap))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, 1.5)])
def test_bfloat16_decode_kernel_matches_attention_at_float32_to_bfloat16_precision(window, softcap):
    """The bfloat16 build reads bfloat16 caches and computes in float32: as
    close to float32 attention over the same (bfloat16) values as bfloat16's
    own rounding of the output allows, and closer than the portable path at
    bfloat16 is."""
    from trioserve.gpu.cpu_kernels.attention import load_decode_kernel

    kernel = load_decode_kernel(torch.device("cpu"), torch.bfloat16)
    assert kernel is not None
    seqs, steps = prefills_then_decodes(3, (2, 13, 7, 21), 4, D)
    seqs = [{name: t.to(torch.bfloat16) for name, t in seq.items()} for seq in seqs]
    got = run_steps(seqs, steps, 0.3, window, softcap, False, decode_kernel=kernel)
    portable = run_steps(seqs, steps, 0.3, window, softcap, False)
    for seq, out, out_portable, prompt in zip(seqs, got, portable, steps[0], strict=True):
        exact = reference(*(seq[name].float() for name in "qkv"), 0.3, window, softcap)
        assert out.dtype == torch.bfloat16
        decoded = slice(prompt, None)  # the rows the kernel computed (the prompts take SDPA)
        torch.testing.assert_close(out[decoded].float(), exact[decoded], rtol=1e-2, atol=1e-2)
        error, portable_error = ((o[decoded].float() - exact[decoded]).abs().max() for o in (out, out_portable))
        assert error <= portable_error + 1e-3
    with pytest.raises(ValueError, match=r"built for torch\.bfloat16"):
        run_steps(prefills_then_decodes(3, (2,), 1, D)[0], [[2], [1]], 0.3, None, None, False, decode_kernel=kernel)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
def test_a_built_kernel_is_loaded_again_from_our_index(decode_kernel, tmp_path, monkeypatch):
    """Once built, a kernel's library is found through our index, without
    inductor's per-process checks (a worker start saves about a second); an
    index naming a library that is gone is written again."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from trioserve.gpu.cpu_kernels import attention as cpu_attention
    from trioserve.gpu.cpu_kernels import cpp as cpp_kernels

    def load():
        return cpp_kernels.load_or_build(
            "decode-attention", cpu_attention._source(torch.float32), cpu_attention._argtypes(torch.float32)
        )

    index = tmp_path / "index.json"
    monkeypatch.setattr(cpp_kernels, "index_path", lambda *args: index)
    index.write_text('{"path": "/nowhere/kernel.so", "key": "gone"}')
    built = load()  # from inductor (its cache has it: the fixture built it)
    entry = json.loads(index.read_text())
    assert Path(entry["path"]).is_file() and entry["key"] != "gone"
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setattr(cpp_kernels, "index_path", lambda *args: unwritable / "index.json")
    assert load() is built  # no index written, the kernel all the same
    monkeypatch.setattr(cpp_kernels, "index_path", lambda *args: index)

    def no_building(*args, **kwargs):
        raise AssertionError("inductor was asked to build or look up the kernel")

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding", no_building)
    assert load() is built


def shared_prefix_decodes(dtype: torch.dtype, head_dim: int):
    """One decode step over a cache of random K/V whose block tables share
    beginnings as prefix-cache hits do: three sequences start with the same
    75 blocks (300 tokens: two of the kernel's 256-token spans), two of them
    with 3 more; two others share 2 blocks; one shares nothing. -> (q, k, v of
    the new tokens, context lens, tables, caches)."""
    gen = torch.Generator().manual_seed(5)
    caches = [tuple(torch.randn(400, BLOCK, KVH, head_dim, generator=gen).to(dtype) for _ in range(2))]
    fresh = iter(range(100, 400))
    common, pair = list(range(75)), [75, 76, 77]
    tables = [
        common + pair + [next(fresh)],  # 78 shared with the next one, 75 with the third
        common + pair + [next(fresh), next(fresh)],
        [*common, next(fresh)],  # its newest token in the block right after the 75
        [90, 91, next(fresh)],
        [90, 91, next(fresh), next(fresh)],
        [next(fresh) for _ in range(5)],
    ]
    context = [78 * BLOCK + 3, 80 * BLOCK, 75 * BLOCK + 1, 2 * BLOCK + 2, 3 * BLOCK + 1, 5 * BLOCK - 1]
    q, k, v = (torch.randn(1, heads, len(tables), head_dim, generator=gen).to(dtype) for heads in (H, KVH, KVH))
    return q, k, v, context, tables, caches


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap", "head_dim"), [(None, None, 8), (None, 2.0, 44), (5, None, 8)])
def test_decode_kernel_reads_blocks_shared_by_a_group_once_with_the_same_result(window, softcap, head_dim, dtype):
    """Decodes whose tables start with the same blocks (prefix-cache hits)
    form one kernel call per group that reads those blocks once for all
    (``shared_len``): the same attention as each sequence reading its own
    context (float32 attention over the same values, to the dtype's rounding)."""
    from trioserve.gpu.cpu_kernels.attention import load_decode_kernel

    kernel = load_decode_kernel(torch.device("cpu"), dtype)
    assert kernel is not None
    q, k, v, context, tables, caches = shared_prefix_decodes(dtype, head_dim)
    meta = build_metadata([1] * len(tables), context, tables, BLOCK, caches, torch.device("cpu"), decode_kernel=kernel)
    groups = {tuple(g.token_index.tolist()): g.shared_len for g in meta.decodes}
    assert groups == {(0, 1, 2): 75 * BLOCK, (3, 4): 2 * BLOCK, (5,): 0}
    module = SimpleNamespace(layer_idx=0, scaling=0.3)
    with step_metadata(meta):
        out, _ = paged_attention_forward(module, q, k, v, None, sliding_window=window, softcap=softcap)
    for i, (table, length) in enumerate(zip(tables, context, strict=True)):
        # the new token is in the cache now; its context read back through its own table, at float32
        keys, values = (c.float()[table].reshape(-1, KVH, head_dim)[:length].transpose(0, 1) for c in caches[0])
        qi = torch.zeros(H, length, head_dim)
        qi[:, -1] = q[0, :, i].float()
        expected = reference(qi, keys, values, 0.3, window, softcap)[-1]
        tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(out[0, i].float(), expected, **tolerance)


def test_decode_groups_for_the_kernel_share_whole_blocks_short_of_each_newest_token():
    """Only blocks every member's table starts with, and never the block a
    member's newest token is written to."""
    from trioserve.gpu.attention import _shared_prefix_groups

    tables = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [7, 8]]
    # 0 and 2 would share 3 blocks, but 0's newest token is in its third; 3 is alone; 0-2 share 2 blocks
    assert _shared_prefix_groups([1, 1, 1, 1], [9, 12, 13, 5], tables, 4) == [([0, 1, 2], 8), ([3], 0)]
    # block 1 holds 2's newest token: nothing is shared
    assert _shared_prefix_groups([1, 1, 1], [5, 5, 4], [[1, 2], [1, 3], [1]], 4) == [([0, 1, 2], 0)]
    assert _shared_prefix_groups([3, 1, 1], [12, 9, 9], tables[:3], 4) == [([1, 2], 8)]  # prefills are not decodes


def prefills_then_decodes(
    seed: int, prompt_lengths: tuple[int, ...], decodes: int, head_dim: int
) -> tuple[list[dict[str, torch.Tensor]], list[list[int]]]:
    """Random q/k/v for sequences of ``prompt_lengths`` plus ``decodes`` tokens,
    and the steps that prefill each prompt, then decode one token at a time."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [n + decodes for n in prompt_lengths]
    seqs = [
        {name: torch.randn(heads, n, head_dim, generator=gen) for name, heads in (("q", H), ("k", KVH), ("v", KVH))}
        for n in lengths
    ]
    return seqs, [list(prompt_lengths)] + [[1] * len(lengths)] * decodes


@pytest.mark.parametrize("decode_group_blocks", [1, 5, 8])
def test_decodes_in_groups_match_per_sequence_attention(decode_group_blocks):
    """Decodes cut into several padded groups (shortest context first) give
    the same attention as one group."""
    seqs, steps = prefills_then_decodes(1, (2, 13, 7, 5, 17, 9), 3, D)
    got = run_steps(seqs, steps, 0.3, None, None, False, decode_group_blocks=decode_group_blocks)
    for seq, out in zip(seqs, got, strict=True):
        torch.testing.assert_close(out, reference(seq["q"], seq["k"], seq["v"], 0.3))


def test_decode_groups_are_sorted_by_length_and_capped():
    caches = [(torch.zeros(64, BLOCK, KVH, D), torch.zeros(64, BLOCK, KVH, D))]
    context = [9, 2, 30, 5, 14]  # blocks of 4: 3, 1, 8, 2, 4
    tables = [list(range(10 * i, 10 * i + 8)) for i in range(len(context))]
    meta = build_metadata([1] * 5, context, tables, BLOCK, caches, torch.device("cpu"), decode_group_blocks=8)
    groups = [g.token_index.tolist() for g in meta.decodes]
    assert groups == [[1, 3], [0, 4], [2]]  # 2x2 blocks, 2x4 blocks, then 8 blocks alone
    assert [tuple(g.block_tables.shape) for g in meta.decodes] == [(2, 2), (2, 4), (1, 8)]
    assert sorted(i for g in groups for i in g) == list(range(5))


def test_missing_metadata_is_a_clear_error():
    module = SimpleNamespace(layer_idx=0, scaling=1.0)
    q = torch.zeros(1, H, 2, D)
    with pytest.raises(RuntimeError, match="step_metadata"):
        paged_attention_forward(module, q, q[:, :KVH], q[:, :KVH], None)
