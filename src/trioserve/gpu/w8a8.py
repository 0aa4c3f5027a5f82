"""int8 checkpoints in the ``compressed-tensors`` W8A8 format, the one vLLM
serves on the CPU and llm-compressor writes: read by the worker (its
linear layers become ``Int8Linear``) and written by ``trioserve quantize``.

**The format**: ``config.json`` has a ``quantization_config`` with
``quant_method: compressed-tensors``, ``format: int-quantized`` and config
groups whose ``weights`` are 8-bit ints, symmetric, per output channel
(``strategy: channel``; ``tensor``: one scale for the layer), static, and
whose ``input_activations`` are 8-bit ints per token, dynamic (symmetric or
not). Each quantized linear layer ``L`` stores ``L.weight`` (int8 ``[out,
in]``) and ``L.weight_scale`` (float, ``[out, 1]``, or one value): the layer's
weight is ``weight * weight_scale``. Layers in ``ignore`` (the LM head) stay
float and have no scale. Anything else (4-bit or grouped weights, zero
points, static or per-tensor activations, float8, sparsity, a KV cache
scheme) is refused naming the field.

**Served**: each layer with a ``weight_scale`` becomes an ``Int8Linear`` on
its int8 weight and scales as stored (under tensor parallelism, this rank's
share of them). Activations are quantized per token, asymmetrically (over
each token's own range), as ``--quantization int8`` does: where the
checkpoint says symmetric that is the finer of the two (the same per-token
steps or smaller), so the sums are at least as exact as its own scheme's.

**Written** (``write_w8a8``): from a float checkpoint, every linear layer but
the LM head per output channel, symmetric, with activations declared
asymmetric per token (what the kernel does). SmoothQuant's factors cannot be
stored beside the weights in this format, so they are folded into the
weights that feed each layer, where the architecture allows (the Llama
family: ``input_layernorm`` into q, k and v; ``post_attention_layernorm`` into
gate and up; ``v_proj``'s rows into ``o_proj``, one factor per value channel
for the query heads that share it; ``up_proj``'s rows into ``down_proj``),
from one calibration pass (``int8.calibrate``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trioserve.gpu.cpu_kernels import int8
from trioserve.gpu.tensor_shards import local_tensor, split_of

QUANT_METHOD = "compressed-tensors"
FORMAT = "int-quantized"
SCALE = ".weight_scale"
# The norm classes whose weight multiplies their output as it is (y = w * x / rms): a factor folds into it.
FOLDABLE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# The attention classes whose output is each query head's weighted sum of its KV head's values, v_proj's rows.
FOLDABLE_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json", "added_tokens.json",
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint's quantization this engine does not serve, or its weights
    and its config disagree; the message names the file and the field."""


@dataclass(frozen=True)
class W8A8Scheme:
    """What a compressed-tensors W8A8 checkpoint's config says (``read_scheme``)."""

    model_dir: str
    input_symmetric: bool  # how the checkpoint's activations were meant: ours are per token, asymmetric either way
    ignore: tuple[str, ...]


def read_scheme(model_dir: str | Path) -> W8A8Scheme | None:
    """The W8A8 scheme of ``model_dir``'s ``config.json``, or None when it has
    no ``quantization_config``. ``CheckpointError`` naming the field for any
    other quantization."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # no config, or not ours to judge here: the model's loading says what is wrong with it
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: must be an object")
    method = quant.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{where}.quant_method {method!r}: trioserve serves {QUANT_METHOD!r} W8A8 int8 checkpoints "
            "(or a float checkpoint with --quantization int8)"
        )
    _expect(where, quant, "format", (FORMAT,))
    _expect(where, quant, "quantization_status", ("compressed", None))
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(field):
            raise CheckpointError(f"{where}.{field}: not served (W8A8 int8 linear layers only)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups: must name at least one group")
    symmetric = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{at}: must be an object")
        _expect(at, group, "format", (FORMAT, None))
        if group.get("targets") != ["Linear"]:
            raise CheckpointError(f'{at}.targets {group.get("targets")!r}: must be ["Linear"]')
        weights, inputs = group.get("weights"), group.get("input_activations")
        if not isinstance(weights, dict) or not isinstance(inputs, dict):
            raise CheckpointError(f"{at}: needs weights and input_activations (W8A8)")
        # A field left out takes compressed-tensors' default (8 bits, int, symmetric, static; the strategy
        # "tensor", which activations must not have: they are per token here).
        _expect(f"{at}.weights", weights, "num_bits", (8, None))
        _expect(f"{at}.weights", weights, "type", ("int", None))
        _expect(f"{at}.weights", weights, "symmetric", (True, None))
        _expect(f"{at}.weights", weights, "strategy", ("channel", "tensor", None))
        _expect(f"{at}.weights", weights, "dynamic", (False, None))
        _expect(f"{at}.weights", weights, "group_size", (None, -1))
        _expect(f"{at}.weights", weights, "actorder", (None,))
        _expect(f"{at}.input_activations", inputs, "num_bits", (8, None))
        _expect(f"{at}.input_activations", inputs, "type", ("int", None))
        _expect(f"{at}.input_activations", inputs, "strategy", ("token",))
        _expect(f"{at}.input_activations", inputs, "dynamic", (True,))
        if group.get("output_activations") is not None:
            raise CheckpointError(f"{at}.output_activations: not served (must be null)")
        symmetric.add(inputs.get("symmetric", True) is not False)
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(name, str) for name in ignore):
        raise CheckpointError(f"{where}.ignore: must be a list of layer names")
    return W8A8Scheme(str(model_dir), input_symmetric=all(symmetric), ignore=tuple(ignore))


def _expect(where: str, obj: Mapping[str, Any], field: str, allowed: tuple[Any, ...]) -> None:
    value = obj.get(field)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):  # True is not 1
        shown = " or ".join(json.dumps(a) for a in allowed)
        raise CheckpointError(f"{where}.{field} {json.dumps(value)}: must be {shown} (the W8A8 int8 trioserve serves)")


def without_quantization(config: Any) -> Any:
    """A transformers config of a W8A8 checkpoint, its ``quantization_config``
    removed: transformers then loads the model as a float one (each int8
    weight into a float tensor, exactly) and ``load_w8a8`` swaps the layers."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _tensors(model_dir: Path) -> dict[str, Path]:
    """Each tensor's name in the checkpoint, and the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)


def load_w8a8(model: torch.nn.Module, scheme: W8A8Scheme) -> int:
    """Swap each linear layer of ``model`` that the checkpoint stores in int8
    (it has a ``weight_scale``) for an ``Int8Linear`` on its int8 weight and
    scales, this rank's share of them under tensor parallelism; returns how
    many. ``CheckpointError`` naming the tensor where they disagree."""
    model_dir = Path(scheme.model_dir)
    files = _tensors(model_dir)
    scales = {name[: -len(SCALE)] for name in files if name.endswith(SCALE)}
    if not scales:
        raise CheckpointError(f"{model_dir}: quantization_config says W8A8, and no tensor is a weight_scale")
    swapped = 0
    for name, parent, child_name, child in int8._targets(model, keep=()):
        if name not in scales:
            continue
        scales.discard(name)
        if child_name == "lm_head":  # its tensor-parallel plan gathers its output; and it is what protects quality
            raise CheckpointError(f"{model_dir}: {name} in int8 is not served: list it in quantization_config.ignore")
        out_features, in_features = child.weight.shape  # the whole layer's, also of a sharded one
        weight = _read(files, f"{name}.weight")
        if weight.dtype != torch.int8 or tuple(weight.shape) != (out_features, in_features):
            raise CheckpointError(
                f"{model_dir}: {name}.weight is {weight.dtype} {list(weight.shape)}; W8A8 stores it as "
                f"torch.int8 [{out_features}, {in_features}]"
            )
        scale = _read(files, f"{name}{SCALE}").float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(out_features)  # strategy "tensor": one scale for every channel
        if scale.numel() != out_features or not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise CheckpointError(
                f"{model_dir}: {name}{SCALE} must hold {out_features} finite positive scales (or one): "
                f"{list(scale.shape)}"
            )
        split, share = split_of(child)
        if split == "col":
            weight, scale = weight[share], scale[share]
        elif split == "row":
            weight = weight[:, share]
        bias = None if child.bias is None else torch.nn.Parameter(local_tensor(child.bias), requires_grad=False)
        layer = int8.Int8Linear(weight.contiguous(), bias, scale=scale.contiguous(), row_parallel=split == "row")
        setattr(parent, child_name, layer)
        swapped += 1
    if scales:
        raise CheckpointError(
            f"{model_dir}: {len(scales)} weight scales name no linear layer of the model ({sorted(scales)[0]}, ...)"
        )
    return swapped


# --- writing ---------------------------------------------------------------------------------------------------


def _fold(norm: torch.nn.Module, linears: list[torch.nn.Linear], act_max: torch.Tensor) -> bool:
    """Divide ``norm``'s output by SmoothQuant's factors and multiply the
    ``linears``' input columns by them (their product unchanged); False
    where ``norm`` cannot take a factor."""
    weight = getattr(norm, "weight", None)
    if type(norm).__name__ not in FOLDABLE_NORMS or not isinstance(weight, torch.Tensor):
        return False
    w_max = torch.stack([linear.weight.abs().amax(dim=0) for linear in linears]).amax(dim=0)
    factors = int8.smoothing(linears[0].weight, act_max, w_max=w_max)
    weight.div_(factors)
    for linear in linears:
        linear.weight.mul_(factors[None, :])
    return True


def _fold_into_rows(up: torch.nn.Linear, down: torch.nn.Linear, act_max: torch.Tensor) -> None:
    """``down``'s inputs are ``act(gate) * up``: divide ``up``'s output rows by
    the factors and multiply ``down``'s input columns by them."""
    factors = int8.smoothing(down.weight, act_max)
    up.weight.div_(factors[:, None])
    if up.bias is not None:
        up.bias.div_(factors)
    down.weight.mul_(factors[None, :])


def _fold_into_values(attention: torch.nn.Module, act_max: torch.Tensor) -> bool:
    """``o_proj``'s inputs are each head's attention-weighted sum of its KV
    head's values: divide ``v_proj``'s output rows by the factors and multiply
    ``o_proj``'s input columns by them, one factor per value channel for all
    the query heads that share it; False where the attention is not the
    Llama family's."""
    v, o = getattr(attention, "v_proj", None), getattr(attention, "o_proj", None)
    groups, head_dim = getattr(attention, "num_key_value_groups", None), getattr(attention, "head_dim", None)
    if type(attention).__name__ not in FOLDABLE_ATTENTION or type(v) is not torch.nn.Linear:
        return False
    if type(o) is not torch.nn.Linear or not isinstance(groups, int) or not isinstance(head_dim, int):
        return False
    kv_heads = v.out_features // head_dim
    if kv_heads * groups * head_dim != o.in_features:
        return False

    def per_value(x: torch.Tensor) -> torch.Tensor:  # o_proj's inputs [heads * head_dim] -> the values' channels
        return x.view(kv_heads, groups, head_dim).amax(dim=1).reshape(-1)

    factors = int8.smoothing(v.weight.T, per_value(act_max), w_max=per_value(o.weight.abs().amax(dim=0)))
    v.weight.div_(factors[:, None])
    if v.bias is not None:
        v.bias.div_(factors)
    o.weight.mul_(factors.view(kv_heads, 1, head_dim).expand(kv_heads, groups, head_dim).reshape(1, -1))
    return True


def smooth_by_folding(model: torch.nn.Module, act_max: dict[str, torch.Tensor]) -> int:
    """Fold SmoothQuant's factors into the Llama family's layers (module
    docstring); returns how many linear layers were smoothed."""
    smoothed = 0
    for prefix, layer in model.named_modules():
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None:
            continue
        qkv = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
        norms = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
        for norm, linears, first in ((norms[0], qkv, "self_attn.q_proj"), (norms[1], gate_up, "mlp.gate_proj")):
            seen = act_max.get(f"{prefix}.{first}")
            if norm is None or seen is None or not all(type(x) is torch.nn.Linear for x in linears):
                continue
            if _fold(norm, linears, seen):  # type: ignore[arg-type]
                smoothed += len(linears)
        seen = act_max.get(f"{prefix}.self_attn.o_proj")
        if seen is not None and _fold_into_values(attention, seen):
            smoothed += 1
        up, down = getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)
        seen = act_max.get(f"{prefix}.mlp.down_proj")
        if type(up) is torch.nn.Linear and type(down) is torch.nn.Linear and seen is not None:
            _fold_into_rows(up, down, seen)
            smoothed += 1
    return smoothed


def quantization_config() -> dict[str, Any]:
    """What ``write_w8a8`` puts in ``config.json``: W8A8 as compressed-tensors
    writes it, activations declared as our kernel quantizes them."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": {
                    "num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True,
                    "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                    "observer_kwargs": {},
                },
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }  # fmt: skip


def write_w8a8(model_dir: str | Path, out_dir: str | Path, *, smooth: bool = True) -> dict[str, int]:
    """Write ``model_dir`` (a float checkpoint of a causal LM) to ``out_dir``
    as a W8A8 checkpoint (module docstring), with its tokenizer files; returns
    counts (``quantized``, ``smoothed``). ``out_dir`` must not exist yet."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if read_scheme(model_dir) is not None:
        raise CheckpointError(f"{model_dir}: already quantized (config.json has a quantization_config)")
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists (quantize writes a new directory)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    smoothed = 0
    if smooth:
        act_max = int8.calibrate(model, int8.calibration_ids(str(model_dir)))
        smoothed = smooth_by_folding(model, act_max)
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    linears = {name: child for name, _, _, child in int8._targets(model, keep=("lm_head",))}
    for name, tensor in model.state_dict().items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in linears:
            wq, scale = int8.quantize_weight(tensor)
            tensors[name], tensors[layer + SCALE] = wq, scale[:, None].contiguous()
            quantized += 1
        else:
            tensors[name] = tensor.contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: the embedding's
    out_dir.mkdir(parents=True)
    try:
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = quantization_config()
        config["dtype" if "dtype" in config else "torch_dtype"] = "float32"
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in TOKENIZER_FILES:
            if (model_dir / file).is_file():
                shutil.copy(model_dir / file, out_dir / file)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return {"quantized": quantized, "smoothed": smoothed}


def main(argv: list[str] | None = None) -> None:
    """``trioserve quantize``'s child process (``cli/quantize.py``): write
    the checkpoint and print the counts as one JSON line, or what it refuses
    (``{"refused": ...}``: bad input, not a failure of the program)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m trioserve.gpu.w8a8", description=main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", help="the directory to write (it must not exist)")
    parser.add_argument("--no-smooth", dest="smooth", action="store_false")
    args = parser.parse_args(argv)
    os.environ["TQDM_DISABLE"] = "1"  # transformers' loading bars: read when tqdm is imported
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        print(json.dumps(write_w8a8(args.model_dir, args.out_dir, smooth=args.smooth)))
    except CheckpointError as exc:
        print(json.dumps({"refused": str(exc)}))


if __name__ == "__main__":
    main()
