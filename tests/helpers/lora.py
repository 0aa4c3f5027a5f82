"""Random LoRA adapters in PEFT's format for a tiny model, built with PEFT
itself, and the base model with an adapter merged in (PEFT's
``merge_and_unload``): what trioserve's outputs with that adapter must equal."""

from __future__ import annotations

import json
import pathlib

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ATTENTION_AND_MLP = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def write_adapter(
    base_dir: pathlib.Path,
    out: pathlib.Path,
    *,
    r: int,
    targets: list[str],
    seed: int,
    use_rslora: bool = False,
    scale: float = 1.0,
) -> pathlib.Path:
    """A random adapter (A and B both drawn, ``B`` times ``scale``) of rank ``r`` on ``targets``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, use_rslora=use_rslora
    )  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    if scale != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(scale)
    model.save_pretrained(out)
    return out


def merged_model(base_dir: pathlib.Path, adapter_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The base model with the adapter merged into its weights, saved to ``out``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    model.merge_and_unload().save_pretrained(out)
    return out


def edit_config(adapter_dir: pathlib.Path, **changes: object) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
