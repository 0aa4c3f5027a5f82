"""The engine that ``serve``, ``generate`` and ``chat`` run: its model (the
built-in default when none is given) and its config. A model is named as
``vllm serve`` takes it (``model_source.py`` finds it)."""

from __future__ import annotations

import argparse
from typing import Any

from trioserve.config import EngineConfig
from trioserve.engine_options import engine_config
from trioserve.model_source import default_model, resolve_model

DEFAULT_MODEL_SERVED_NAME = "SmolLM2-135M-Instruct"  # the default model's name in the OpenAI API


def command_engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The engine config of ``args`` (``engine_options.engine_config``), its
    model resolved: the default model, converted on first use, when none is
    given; ``fields``: the command's own (serve's hosts)."""
    name = model_argument(args)
    model = default_model() if name is None else resolve_model(name, args.revision, args.download_dir)
    return engine_config(args, model, **fields)


def model_argument(args: argparse.Namespace) -> str | None:
    """The model given: ``serve``'s positional MODEL (vLLM's) or ``--model``;
    ``ValueError`` when both are given and differ, or it is empty."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"the model is given twice: {positional!r} and --model {args.model!r}")
    name = positional if positional is not None else args.model
    if name is not None and not name.strip():  # "" would be the working directory
        raise ValueError("MODEL: empty; give a model directory, a .gguf file or a Hugging Face id (or none)")
    return name  # type: ignore[no-any-return]
