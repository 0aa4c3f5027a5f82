"""Tiny random-weight models and their byte-level tokenizer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trioserve.gpu.tiny_models import (
    ARCHITECTURES,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_tokenizer,
    write_tiny_model,
)

pytestmark = pytest.mark.model


def test_tokenizer_is_byte_level_and_prepends_bos(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, wörld! 🎉"
    ids = tokenizer(text).input_ids
    assert ids == [BOS_ID] + [3 + b for b in text.encode()]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert len(tokenizer) == VOCAB_SIZE


def test_tokenizer_json_alone_prepends_bos(tiny_model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_dir("llama") / "tokenizer.json"))
    assert tokenizer.encode("ab").ids == [BOS_ID, 3 + ord("a"), 3 + ord("b")]


def test_same_seed_gives_same_weight_bytes(tmp_path, tiny_model_dir):
    def weights(d):
        return (d / "model.safetensors").read_bytes()

    again = write_tiny_model(tmp_path / "again", "qwen2", seed=0)
    other = write_tiny_model(tmp_path / "other", "qwen2", seed=1)
    assert weights(again) == weights(tiny_model_dir("qwen2"))
    assert weights(other) != weights(again)


def test_config_overrides_and_unknown_arch(tmp_path):
    from transformers import AutoConfig

    write_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    assert AutoConfig.from_pretrained(tmp_path).num_hidden_layers == 3
    with pytest.raises(ValueError, match="arch"):
        write_tiny_model(tmp_path / "x", "gpt-7")


def test_module_cli_writes_a_model_that_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "cli-model"
    cmd = [sys.executable, "-m", "trioserve.gpu.tiny_models", str(out), "--arch", "qwen3", "--seed", "3"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3" and model.generation_config.eos_token_id == EOS_ID
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    ids = torch.tensor([[BOS_ID, 50, 60]])
    assert model(ids).logits.shape == (1, 3, VOCAB_SIZE)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_argmax_has_a_clear_margin(tiny_model_dir, arch):
    """Random weights with a large init range: the top two logits are far
    apart compared to float noise, so kernels agree on greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), attn_implementation="eager")
    ids = torch.randint(3, VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model(ids).logits[0].topk(2, dim=-1).values  # [64, 2]
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4


def test_every_architecture_loads_whole_and_a_checkpoint_lacking_weights_is_refused_naming_them(
    tmp_path, tiny_model_dir
):
    """Found: weights the config asks for but the checkpoint lacks (a layer
    more in config.json, no lm_head) were filled with random values, logged
    by transformers and served."""
    import json
    import shutil

    from trioserve.gpu.sharding import load_model

    for arch in sorted(ARCHITECTURES):
        assert load_model(str(tiny_model_dir(arch)), 1) is not None
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"the checkpoint lacks \d+ weights that LlamaForCausalLM needs \(model\.layers\.2\."
    ):
        load_model(str(model), 1)
