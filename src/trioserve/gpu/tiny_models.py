"""Tiny random-weight models in Hugging Face layout, for tests and demos.

A written model is a complete local directory (``config.json``, safetensors
weights, ``generation_config.json``, ``tokenizer.json``) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load offline. The same ``(arch, seed, overrides)`` always gives the same
weight bytes.

Command line (used by the CLI to build its default model)::

    python -m trioserve.gpu.tiny_models OUT_DIR --arch llama [--seed 0]
"""

from __future__ import annotations

import argparse
import pathlib
from typing import TYPE_CHECKING, Any

from trioserve.byte_level import char_of_byte

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # specials, then one token per byte

# Shared by every architecture: hidden 64, 2 layers, 4 query heads, 2 KV heads.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Large enough that the top two logits are rarely within float noise of
    # each other, so greedy decoding is stable across attention kernels.
    "initializer_range": 0.2,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

# What makes each architecture's attention different from Llama's.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False, "use_sliding_window": False},  # q/k/v biases
    "qwen3": {"tie_word_embeddings": False, "use_sliding_window": False},  # q/k RMS norms
    "gemma2": {  # softcapped scores, sliding window on every other layer, odd scaling
        "tie_word_embeddings": False,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 30.0,
    },
}


# A plain chat template: "<s>role: content\n" per message, then "<s>assistant: ".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token + message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant: ' }}{% endif %}"
)


def build_tokenizer(path: str | pathlib.Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges: ids 0-2 are ``<pad> <s> </s>``, then
    one id per byte (``3 + byte``). Encoding prepends ``<s>`` as Llama does.

    Returns a ``transformers.PreTrainedTokenizerFast``; with ``path`` it is also
    saved there (``tokenizer.json``, ``tokenizer_config.json`` and its chat
    template, ``CHAT_TEMPLATE``, as ``chat_template.jinja``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + b for b, char in char_of_byte().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[BOS_ID]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=bos,
        eos_token=SPECIAL_TOKENS[EOS_ID],
        model_max_length=_COMMON["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(str(path))
    return tokenizer


def tiny_config(arch: str = "llama", **config_overrides: Any) -> PretrainedConfig:
    """The ``transformers`` config of a tiny model of ``arch``."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: must be one of {sorted(ARCHITECTURES)} (got {arch!r})")
    return AutoConfig.for_model(arch, **{**_COMMON, **ARCHITECTURES[arch], **config_overrides})


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded generator, in name order.

    Matrices and biases get N(0, std); norm weights keep their constant
    default (1, or 0 for the ``1 + w`` norms) plus N(0, std / 2) noise.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(param.detach() + noise * (std / 2))
            else:
                param.copy_(noise * std)


def write_tiny_model(
    path: str | pathlib.Path, arch: str = "llama", *, seed: int = 0, **config_overrides: Any
) -> pathlib.Path:
    """Write a tiny random-weight ``arch`` model (and its tokenizer) to ``path``.

    Architectures: ``llama``, ``qwen2``, ``qwen3``, ``gemma2``. Keyword
    arguments override config fields. Returns the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, config.initializer_range)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trioserve.gpu.tiny_models",
        description="Write a tiny random-weight model (with its tokenizer) to a directory.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    parser.add_argument("--seed", type=int, default=0, help="weights depend only on this seed")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    print(write_tiny_model(args.out_dir, args.arch, seed=args.seed))


if __name__ == "__main__":
    main()
