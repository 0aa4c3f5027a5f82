"""Pre-packed linear layers (``gpu/cpu_linear.py``: our float32 GEMM on
panels, oneDNN's packed weights): the same products as ``F.linear``, swapped
into a model in place, counted like the weights they replace. Greedy identity with them is checked by test_gpu_runner.py
and test_engine_models.py (the runner packs on the CPU at float32)."""

from __future__ import annotations

import pytest

from trioserve.config import EngineConfig

torch = pytest.importorskip("torch")

from trioserve.gpu import cpu_linear, sharding  # noqa: E402

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
    ("in_features", "out_features", "bias"), [(24, 40, False), (24, 40, True), (64, 16, True), (7, 3, False)]
)
def test_panel_linear_matches_f_linear_for_any_rows_and_ragged_panels(in_features, out_features, bias):
    """Our float32 GEMM: every tail of its 6-row tiles, rows past one
    256-row chunk, no rows, a last panel short of 16 columns, any leading shape."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    panel = cpu_linear.PanelLinear(linear)
    assert panel.panels.shape == (-(-out_features // 16), in_features, 16)
    for rows in [0, 1, 2, 3, 4, 5, 6, 7, 13, 300]:
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(in_features, 6).t()  # not contiguous
    torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 5, in_features)
    torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32 only"):
        cpu_linear.PanelLinear(torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 rows"):  # never read as the wrong type
        panel(torch.randn(3, in_features).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 rows"):
        cpu_linear.panel_gemm(torch.randn(3, in_features + 1), panel.panels, None, out_features)


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

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_linear, "_gemm", no_compiler)
    third = model()
    assert cpu_linear.pack_linears(third) == 2
    assert all(type(third[name]) is cpu_linear.PackedLinear for name in "ab")


def test_runner_packs_every_linear_and_counts_weights_as_before(tiny_model_dir, monkeypatch):
    from trioserve.gpu.model_runner import ModelRunner

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


def test_packing_applies_only_to_the_cpu_at_float32_or_native_bfloat16():
    cpu = torch.device("cpu")
    assert not cpu_linear.packing_supported(torch.device("cuda"), torch.float32)
    assert not cpu_linear.packing_supported(cpu, torch.float16)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_linear.packing_supported(cpu, torch.bfloat16) == native
