"""The engine that ``serve``, ``generate`` and ``chat`` run: its model (the
built-in default when ``--model`` is not given) and its config."""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

from trioserve.config import EngineConfig
from trioserve.engine_options import engine_config
from trioserve.errors import EngineStartupError
from trioserve.nurseries.supervision.process import describe_exit

DEFAULT_MODEL_SERVED_NAME = "SmolLM2-135M-Instruct"  # the default model's name in the OpenAI API


def command_engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The engine config of ``args`` (``engine_options.engine_config``), its
    model resolved: the default model, converted on first use, when there
    is no ``--model``; ``fields``: the command's own (serve's hosts)."""
    model = _default_model() if args.model is None else _absolute_if_here(args.model)
    return engine_config(args, model, **fields)


def _default_model() -> str:
    """The built-in default model's directory, converted on first use; a
    failure (its package missing, the cache directory unusable, the
    conversion failing) is a start-up error (exit 3) saying what to do."""
    from trioserve.default_model import default_model_dir

    try:
        return str(default_model_dir())
    except OSError as exc:
        raise EngineStartupError(str(exc), stage="model-load") from None
    except subprocess.CalledProcessError as exc:
        why = "its error is above" if exc.returncode > 0 else f"the converter {describe_exit(exc.returncode)}"
        raise EngineStartupError(
            f"converting the default model failed (exit code {exc.returncode}; {why})", stage="model-load"
        ) from None


def _absolute_if_here(path: str) -> str:
    """``path`` made absolute when it names something here: a child started
    after the working directory was removed starts in ``/`` (every restart
    after a deploy directory was replaced must still find ``--model ./model``)."""
    return os.path.abspath(path) if os.path.exists(path) else path
