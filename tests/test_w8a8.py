"""compressed-tensors W8A8 int8 checkpoints (``gpu/w8a8.py``): ``trioserve
quantize`` writes one from a float checkpoint; compressed-tensors itself (the
format's library, through transformers) reads it back to the same weights;
the worker serves it with the greedy tokens of the same int8 layers in plain
torch; the smoothing folded into it leaves the float model's logits as they
were; every other quantization is refused naming its field."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.reference import greedy_tokens

from test_gpu_int8 import int8_runner_greedy
from test_gpu_runner import make_prompts

torch = pytest.importorskip("torch")

from trioserve.gpu import w8a8  # noqa: E402
from trioserve.gpu.cpu_kernels import int8  # noqa: E402

pytestmark = pytest.mark.model

ARCHITECTURES = ["llama", "qwen2", "qwen3"]  # the Llama family, whose layers the smoothing folds into


class CheckpointInt8(torch.nn.Module):
    """A linear layer as the checkpoint stores it (int8, scales), in plain torch."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.wq, self.scale, self.bias = weight, scale.reshape(-1).float(), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8.int8_reference(x.reshape(-1, x.shape[-1]), self.wq, self.scale, self.bias)
        return y.view(*x.shape[:-1], -1)


def reference_w8a8_greedy(checkpoint, prompts: list[list[int]], max_tokens: int, greedy=greedy_tokens) -> list:
    """transformers' greedy ``generate()`` of the checkpoint (eager attention), each int8 layer in plain torch
    (``greedy``: as ``test_gpu_int8.reference_int8_greedy``'s)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = w8a8.without_quantization(AutoConfig.from_pretrained(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, attn_implementation="eager").eval()
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        for name, parent, child_name, child in int8._targets(model, keep=("lm_head",)):
            weight, scale = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
            setattr(parent, child_name, CheckpointInt8(weight, scale, child.bias))
    return [greedy(model, prompt, max_tokens) for prompt in prompts]


@pytest.fixture(scope="module")
def written(tiny_model_dir, tmp_path_factory):
    """``{arch: the W8A8 checkpoint written from the tiny model}``, each written once for the module."""
    out = {}
    for arch in ARCHITECTURES:
        out[arch] = tmp_path_factory.mktemp("w8a8") / arch
        counts = w8a8.write_w8a8(tiny_model_dir(arch), out[arch])
        layers = 2  # the tiny models' decoder layers
        assert counts == {"quantized": 7 * layers, "smoothed": 7 * layers}, (arch, counts)
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_written_checkpoint_served_gives_its_int8_layers_greedy_tokens(written, arch):
    """Chunked prefills, decodes beside them, a preemption: the tokens of the checkpoint's int8 layers in plain
    torch, token for token."""
    checkpoint = written[arch]
    prompts = make_prompts([5, 23, 41, 2])
    expected = reference_w8a8_greedy(checkpoint, prompts, 10)
    quantized, got = int8_runner_greedy(checkpoint, prompts, 10)  # no --quantization: the checkpoint says it
    assert got == expected and quantized[0].inv is None  # its smoothing is in its weights


def test_compressed_tensors_reads_the_written_checkpoint_to_its_int8_weights_times_scales(written):
    """The format's own library validates the config and, through transformers, dequantizes each layer to
    ``weight * weight_scale``; the layers it leaves float (the LM head, the norms) are the checkpoint's."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    checkpoint = written["qwen2"]
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.format == "int-quantized" and parsed.ignore == ["lm_head"]
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    layers = dict(model.named_modules())
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        for name, _, _, _ in int8._targets(model, keep=("lm_head",)):
            weight, scale = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
            assert weight.dtype == torch.int8 and scale.shape == (weight.shape[0], 1)
            assert torch.allclose(layers[name].weight, weight.float() * scale), name
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert torch.equal(layers["model.layers.0.input_layernorm"].weight, norm)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_folded_smoothing_leaves_the_float_models_logits_as_they_were(tiny_model_dir, arch):
    """Norms into q, k, v and gate, up; v's rows into o (one factor per value channel, shared by a KV head's
    query heads: the tiny models have 4 query heads over 2); up's rows into down."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), attn_implementation="eager").eval()
    ids = torch.tensor([make_prompts([30])[0]])
    with torch.inference_mode():
        before = model(ids).logits
        act_max = int8.calibrate(model, int8.calibration_ids(str(tiny_model_dir(arch))))
        assert w8a8.smooth_by_folding(model, act_max) == 7 * model.config.num_hidden_layers
        after = model(ids).logits
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_quantize_writes_in_a_child_and_refuses_an_existing_output_and_a_quantized_input(
    written, tiny_model_dir, tmp_path, capsys
):
    """``trioserve quantize`` (its child process imports torch, the command does not): the checkpoint, then
    each refusal one line and exit status 2, with nothing left behind."""
    from trioserve.cli import main

    assert main(["quantize", str(tmp_path / "out"), "--model", str(tiny_model_dir("llama")), "--no-smooth"]) == 0
    assert w8a8.read_scheme(tmp_path / "out") is not None
    assert "14 linear layers in int8 (0 smoothed)" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "out"), "--model", str(tiny_model_dir("llama"))]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "again"), "--model", str(written["llama"])]) == 2
    assert "already quantized (config.json has a quantization_config)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no half-written directory
    with pytest.raises(w8a8.CheckpointError, match="already exists"):
        w8a8.write_w8a8(tiny_model_dir("llama"), tmp_path / "out")


GROUP = "quantization_config.config_groups.group_0"
BAD_CONFIGS = [  # (a change to the written config, the field its error names)
    (lambda q: q.update(quant_method="awq"), "quantization_config.quant_method 'awq'"),
    (lambda q: q.update(format="pack-quantized"), "quantization_config.format"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_config.quantization_status"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme"),
    (lambda q: q.update(config_groups={}), "quantization_config.config_groups"),
    (lambda q: q["config_groups"]["group_0"].update(targets=["Embedding"]), f"{GROUP}.targets"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), f"{GROUP}.weights.num_bits 4"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), f"{GROUP}.weights.symmetric"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128), "weights.strategy"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), f"{GROUP}.weights.type"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "input_activations.dynamic"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"), "activations.strategy"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None), "needs weights and input_activations"),
    (lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}), "output_activations"),
]


def test_fields_left_out_take_the_formats_defaults(written, tmp_path):
    """compressed-tensors' defaults: 8-bit symmetric static int weights, one scale per layer where no strategy is
    given; activations must still say dynamic, per token."""
    checkpoint = tmp_path / "terse"
    shutil.copytree(written["llama"], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"] = {"strategy": "channel"}
    group["input_activations"] = {"strategy": "token", "dynamic": True}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert w8a8.read_scheme(checkpoint) == w8a8.W8A8Scheme(str(checkpoint), input_symmetric=True, ignore=("lm_head",))
    del group["input_activations"]["dynamic"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(w8a8.CheckpointError, match=r"input_activations\.dynamic null: must be true"):
        w8a8.read_scheme(checkpoint)


@pytest.mark.parametrize(("change", "names"), BAD_CONFIGS)
def test_each_other_quantization_is_refused_naming_its_field(written, tmp_path, change, names):
    checkpoint = tmp_path / "bad"
    shutil.copytree(written["llama"], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    change(config["quantization_config"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(w8a8.CheckpointError, match=r"config\.json: ") as refused:
        w8a8.read_scheme(checkpoint)
    assert names in str(refused.value)


def test_weights_that_disagree_with_the_config_are_refused_naming_the_tensor(written, tiny_model_dir, tmp_path):
    """A float weight where int8 is said; a scale of the wrong size; a scale naming no layer; the LM head in int8;
    ``quantization="compressed-tensors"`` on a float checkpoint. Each refused at load, naming it."""
    from safetensors.torch import load_file, save_file

    from trioserve.config import EngineConfig
    from trioserve.gpu.model_runner import ModelRunner

    def broken(name: str, edit) -> str:
        checkpoint = tmp_path / name
        shutil.copytree(written["llama"], checkpoint)
        tensors = load_file(checkpoint / "model.safetensors")
        edit(tensors)
        save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError) as refused:
            ModelRunner(EngineConfig(model=str(checkpoint))).load()
        return str(refused.value)

    q = "model.layers.0.self_attn.q_proj"
    assert f"{q}.weight is torch.float32" in broken(
        "float", lambda t: t.update({f"{q}.weight": t[f"{q}.weight"].float()})
    )
    assert f"{q}.weight_scale must hold 64" in broken(
        "scale", lambda t: t.update({f"{q}.weight_scale": torch.ones(3, 1)})
    )
    assert "name no linear layer" in broken("stray", lambda t: t.update({"model.nothing.weight_scale": torch.ones(1)}))
    lm_head = {"lm_head.weight": torch.zeros(259, 64, dtype=torch.int8), "lm_head.weight_scale": torch.ones(259, 1)}
    message = broken("head", lambda t: t.update(lm_head))
    assert "lm_head in int8 is not served" in message or "lm_head.weight is" in message
    with pytest.raises(ValueError, match="no compressed-tensors W8A8 scheme"):
        ModelRunner(EngineConfig(model=str(tiny_model_dir("llama")), quantization="compressed-tensors")).load()
