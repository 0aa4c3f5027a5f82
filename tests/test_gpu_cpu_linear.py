"""Pre-packed linear layers (``gpu/cpu_kernels/linear.py``: our float32 GEMM on
panels, oneDNN's packed weights): the same products as ``F.linear``, swapped
into a model in place, counted like the weights they replace. Greedy identity with them is checked by test_gpu_runner.py
and test_engine_models.py (the runner packs on the CPU at float32)."""

from __future__ import annotations

import pytest

from trioserve.config import EngineConfig

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from trioserve.gpu import sharding  # noqa: E402
from trioserve.gpu.cpu_kernels import linear as cpu_linear  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_on_any_leading_shape(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias).requires_grad_(False)
    packed = cpu_linear.PackedLinear(linear)
    for shape in [(1, 24), (7, 24), (2, 5, 24)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(24, 6).t()  # not contiguous
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [(24, 40, False), (24, 40, True), (64, 16, True), (7, 3, False), (24, 20, True), (9, 64, False)],
)
def test_panel_linear_matches_f_linear_for_any_rows_and_ragged_panels(in_features, out_features, bias):
    """Our float32 GEMM: every tail of its tiles (6 rows on AVX2, 12 on
    AVX-512), rows past one 256-row chunk, no rows, a last panel short of 16
    columns, a tile of two panels whose second is short, any leading shape."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    assert_panel_matches(linear, lambda got, x: torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_of_the_gemm_computes_the_same_products(dtype):
    """The kernel built for 256-bit vectors (AVX2's tiles, wherever the host
    has wider ones) against the host's own build and the exact product."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 host with AVX2 (this one: {torch.backends.cpu.get_cpu_capability()})")
    torch.manual_seed(2)
    for in_features, out_features in [(24, 40), (64, 16), (9, 20)]:
        linear = torch.nn.Linear(in_features, out_features).to(dtype).requires_grad_(False)
        panels = cpu_linear.to_panels(linear.weight)
        for rows in [1, 5, 6, 7, 11, 12, 13, 25, 300]:
            x = torch.randn(rows, in_features).to(dtype)
            narrow = cpu_linear.panel_gemm(x, panels, linear.bias, out_features, simdlen=256)
            wide = cpu_linear.panel_gemm(x, panels, linear.bias, out_features)
            exact = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(narrow.float(), exact, rtol=tol, atol=tol)
            torch.testing.assert_close(narrow, wide, rtol=tol, atol=tol)


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(24, 40, True), (64, 16, False), (7, 3, True)])
def test_bfloat16_panel_linear_sums_in_float32_and_rounds_once(in_features, out_features, bias):
    """The bfloat16 build: bfloat16 weights and rows, float32 sums, the
    output rounded once; as close to the exact product as bfloat16 allows,
    and no further from it than ``F.linear`` at bfloat16."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16).requires_grad_(False)

    def close(got, x):
        exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)
        if x.numel():
            assert (got.float() - exact).abs().max() <= (linear(x).float() - exact).abs().max() + 1e-2

    assert_panel_matches(linear, close)


def assert_panel_matches(linear, check):
    in_features, out_features = linear.in_features, linear.out_features
    panel = cpu_linear.PanelLinear(linear)
    assert panel.panels.shape == (-(-out_features // 16), in_features, 16)
    dtype = linear.weight.dtype
    for rows in [0, *range(1, 14), 23, 25, 300]:
        x = torch.randn(rows, in_features).to(dtype)
        check(panel(x), x)
    x = torch.randn(in_features, 6).to(dtype).t()  # not contiguous
    check(panel(x), x)
    x = torch.randn(2, 5, in_features).to(dtype)
    check(panel(x).flatten(0, 1), x.flatten(0, 1))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="rows of"):  # never read as the wrong type
        panel(torch.randn(3, in_features).to(other))
    with pytest.raises(ValueError, match="rows of"):
        cpu_linear.panel_gemm(torch.randn(3, in_features + 1).to(dtype), panel.panels, None, out_features)
    with pytest.raises(ValueError, match="float32 or bfloat16 only"):
        cpu_linear.PanelLinear(torch.nn.Linear(4, 4).to(torch.float16))


def test_float32_takes_our_gemm_and_onednn_where_asked_or_where_it_cannot_be_built(monkeypatch):
    def model():
        return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 4), "b": torch.nn.Linear(4, 8)})

    first = model()
    assert cpu_linear.pack_linears(first) == 2
    assert all(type(first[name]) is cpu_linear.PanelLinear for name in "ab")
    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "onednn")
    second = model()
    assert cpu_linear.pack_linears(second) == 2
    assert all(type(second[name]) is cpu_linear.PackedLinear for name in "ab")
    monkeypatch.delenv(cpu_linear.PACKED_LINEAR_ENV)

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_linear, "_gemm", no_compiler)
    third = model()
    assert cpu_linear.pack_linears(third) == 2
    assert all(type(third[name]) is cpu_linear.PackedLinear for name in "ab")


def test_runner_packs_every_linear_and_counts_weights_as_before(tiny_model_dir, monkeypatch):
    from trioserve.gpu.model_runner import ModelRunner

    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "ours")  # one kernel for all (the timed choice: its own tests)
    config = EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=16)
    runner = ModelRunner(config)
    runner.load()
    assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())
    assert any(type(m) is cpu_linear.PanelLinear for m in runner.model.modules())  # float32: our GEMM
    packed_count = sharding.local_parameters(runner.model)

    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "0")
    plain = ModelRunner(config)
    plain.load()
    assert any(type(m) is torch.nn.Linear for m in plain.model.modules())
    assert sharding.local_parameters(plain.model) == packed_count
    tied = plain.model.lm_head.weight is plain.model.get_input_embeddings().weight
    assert runner.model.lm_head.tied == tied


def test_a_tied_lm_head_is_counted_once():
    embed = torch.nn.Embedding(30, 8)
    model = torch.nn.ModuleDict(
        {"embed": embed, "head": torch.nn.Linear(8, 30, bias=False), "up": torch.nn.Linear(8, 4)}
    )
    model["head"].weight = embed.weight
    before = sharding.local_parameters(model)
    assert cpu_linear.pack_linears(model) == 2
    assert model["head"].tied and not model["up"].tied
    assert sharding.local_parameters(model) == before == (30 * 8 + 8 * 4 + 4, (30 * 8 + 8 * 4 + 4) * 4)


def test_packing_applies_to_the_cpu_at_float32_and_bfloat16_with_onednn_where_it_is_native(monkeypatch):
    cpu = torch.device("cpu")
    assert not cpu_linear.packing_supported(torch.device("cuda"), torch.float32)
    assert not cpu_linear.packing_supported(cpu, torch.float16)
    assert cpu_linear.packing_supported(cpu, torch.float32) and cpu_linear.packing_supported(cpu, torch.bfloat16)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    expected = cpu_linear.PackedLinear if native else cpu_linear.PanelLinear
    assert cpu_linear._packed_class(torch.bfloat16) is expected
    assert cpu_linear._packed_class(torch.float32) is cpu_linear.PanelLinear
    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "onednn")
    assert cpu_linear._packed_class(torch.bfloat16) is (cpu_linear.PackedLinear if native else None)
    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "0")
    assert not cpu_linear.packing_supported(cpu, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bench_peak_gemm_measures_every_path_that_applies(tiny_model_dir, dtype):
    """The yardstick of model FLOP utilisation: F.linear, our GEMM, and
    oneDNN's packed weights only where oneDNN packs the dtype here."""
    from trioserve.bench.baselines import run_peak_gemm

    config = EngineConfig(model=str(tiny_model_dir("llama")), dtype=dtype, max_num_batched_tokens=64)
    peak = run_peak_gemm(config, None)  # type: ignore[arg-type]  # the workload does not enter into it
    expected = {"F.linear", "our GEMM (panels)"} | (
        {"oneDNN packed"} if cpu_linear.onednn_packs(getattr(torch, dtype)) else set()
    )
    assert set(peak["rates"]) == expected
    assert peak["dtype"] == dtype and peak["flops_per_s"] == max(peak["rates"].values()) > 0
