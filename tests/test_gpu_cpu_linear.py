"""oneDNN pre-packed linear layers (``gpu/cpu_linear.py``): the same products
as ``F.linear``, swapped into a model in place, counted like the weights
they replace. Greedy identity with them is checked by test_gpu_runner.py
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


def test_runner_packs_every_linear_and_counts_weights_as_before(tiny_model_dir, monkeypatch):
    from trioserve.gpu.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=16)
    runner = ModelRunner(config)
    runner.load()
    assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())
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
