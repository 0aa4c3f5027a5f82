"""A model directory, checked in the front-end before any process starts,
so that a wrong path is one line naming it, not a worker's traceback.

What a directory must hold: ``tokenizer.json`` (the front-end reads it,
``frontend/text/tokenizer.py``); for the transformers runner also ``config.json``
naming a ``model_type``, and weights (``*.safetensors`` or
``pytorch_model*.bin``). The fake runner reads only the first two.
"""

from __future__ import annotations

import json
from pathlib import Path

from trioserve.config import EngineConfig
from trioserve.errors import EngineStartupError
from trioserve.frontend.text.chat_template import ChatTemplate
from trioserve.frontend.text.tokenizer import Tokenizer

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def load_model_dir(model: str, *, needs_weights: bool) -> Tokenizer:
    """The directory's tokenizer, once the directory is checked. Raises
    ``ValueError`` (or ``OSError``) with one line naming the path and what is
    wrong."""
    directory = Path(model)
    tokenizer = Tokenizer.from_dir(directory)  # names a missing directory or tokenizer.json
    if needs_weights:
        _check_config(directory / "config.json")
        if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            raise ValueError(f"no weights in {str(directory)!r} (expected *.safetensors or pytorch_model*.bin)")
    return tokenizer


def _check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config.json not found in {str(path.parent)!r}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{path}: names no model_type (it is not a transformers model's config)")


def load_text(config: EngineConfig) -> tuple[Tokenizer, ChatTemplate | None]:
    """The engine's tokenizer and chat template: the model directory's, once
    it is checked, or ``config.tokenizer``'s directory's, and
    ``config.chat_template`` when given; a missing or broken one is a
    start-up error naming the path."""
    try:
        tokenizer = load_model_dir(config.model, needs_weights=config.runner == "hf")
        text_dir = config.model
        if config.tokenizer is not None:  # its own tokenizer (and chat template, unless one is given)
            tokenizer = Tokenizer.from_dir(config.tokenizer)
            text_dir = config.tokenizer
        if config.chat_template is not None:
            return tokenizer, ChatTemplate.from_source(config.chat_template, text_dir)
        return tokenizer, ChatTemplate.from_dir(text_dir)
    except (OSError, ValueError) as exc:  # each names the directory or the file
        raise EngineStartupError(str(exc), stage="tokenizer") from None
