"""The fused element-wise kernels of the eager CPU runner
(``gpu/cpu_kernels/fused.py``): the same values as transformers' RMSNorm and
``silu(gate) * up``, swapped in only where a module computes what they do.
Greedy identity with them is checked by test_gpu_runner.py and
test_engine_models.py (the runner fuses on the CPU at float32, eager)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from trioserve.gpu.cpu_kernels import fused  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(fused._kernel() is None, reason="the fused kernel cannot be built here (no compiler)"),
]


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm at float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (32, 576), (1, 2048, 576), (2, 5, 4, 16), (7, 3)])
def test_the_kernels_give_torchs_values_on_any_shape(shape, threads):
    """A decode's rows and a prefill's (the threaded path), a width that is
    not a multiple of the vector, Qwen3's per-head norms' 4-D input."""
    generator = torch.Generator().manual_seed(0)
    x, up = torch.randn(shape, generator=generator) * 3, torch.randn(shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        normed, gated = fused.rms_norm(x, weight, 1e-6), fused.silu_mul(x, up)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(normed, reference_rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(gated, F.silu(x) * up, rtol=2e-6, atol=2e-6)


def test_inputs_that_are_not_contiguous_are_read_as_their_values():
    x = torch.randn(16, 40).t()  # [40, 16], column-major
    weight = torch.randn(16)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))
    gate, up = torch.randn(2, 8, 32).transpose(0, 1), torch.randn(8, 2, 32)
    torch.testing.assert_close(fused.silu_mul(gate, up), F.silu(gate) * up)


def test_a_gate_and_up_of_other_shapes_are_refused():
    with pytest.raises(ValueError, match=r"silu_mul: gate \(2, 8\) and up \(2, 4\) differ"):
        fused.silu_mul(torch.randn(2, 8), torch.randn(2, 4))


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_norm_and_mlp_is_fused_and_the_logits_stay(tiny_model_dir, arch):
    """Llama: two norms per layer and the final one; Qwen3 also its query and
    key norms. Fusing twice changes nothing."""
    model = _load(tiny_model_dir(arch))
    layers = model.config.num_hidden_layers
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.inference_mode():
        before = model(ids).logits
        norms, mlps = fused.fuse_elementwise(model)
        after = model(ids).logits
    assert (norms, mlps) == ((4 if arch == "qwen3" else 2) * layers + 1, layers)
    assert all("forward" in vars(layer.mlp) for layer in model.model.layers)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert fused.fuse_elementwise(model) == (0, 0)


def test_an_input_of_another_dtype_takes_the_modules_own_forward(tiny_model_dir):
    model = _load(tiny_model_dir("llama"))
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        want_norm, want_mlp = norm(x.double()), mlp.double()(x.double())
        mlp.float()
        assert fused.fuse_elementwise(model) != (0, 0)
        mlp.double()
        torch.testing.assert_close(norm(x.double()), want_norm)
        torch.testing.assert_close(mlp(x.double()), want_mlp)


def test_a_norm_of_one_plus_weight_and_a_gelu_mlp_are_left_as_they_are(tiny_model_dir):
    """Gemma 2's RMSNorm scales by ``1 + weight`` and its MLP uses GELU: by
    their outputs on a random input neither is what the kernels compute."""
    model = _load(tiny_model_dir("gemma2"))
    assert fused.fuse_elementwise(model) == (0, 0)
    assert not any("forward" in vars(module) for module in model.modules())


def test_the_switch_leaves_every_module_as_it_is(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(fused.FUSED_ENV, "0")
    model = _load(tiny_model_dir("llama"))
    assert fused.fuse_elementwise(model) == (0, 0)
    assert not any("forward" in vars(module) for module in model.modules())
