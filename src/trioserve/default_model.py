"""The built-in default model: a tiny Llama with random weights.

Built once, deterministically, in a cache directory, by a subprocess (so the
front-end never imports torch). Its text is gibberish: it exists so that
``trioserve generate`` and ``trioserve serve`` run on a fresh machine with no
model at hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "default-llama-random-v1"
_COMPLETE_MARKER = ".trioserve-complete"


def cache_dir() -> Path:
    """``$TRIOSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trioserve``, else ``~/.cache/trioserve``."""
    if os.environ.get("TRIOSERVE_CACHE_DIR"):
        return Path(os.environ["TRIOSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trioserve"


def default_model_dir(*, announce: bool = True) -> Path:
    """The default model's directory, building it first if needed (a few seconds)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / _COMPLETE_MARKER).exists():
        if announce:
            _announce(target, built=False)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        building = Path(tmp) / "model"
        subprocess.run(
            [sys.executable, "-m", "trioserve.gpu.tiny_models", str(building), "--arch", "llama", "--seed", "0"],
            check=True,
            stdout=subprocess.DEVNULL,  # it prints the directory; we announce the final one
        )
        (building / _COMPLETE_MARKER).write_text("built by trioserve\n")
        shutil.rmtree(target, ignore_errors=True)  # a half-built one from a crash
        try:
            os.rename(building, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():  # not a concurrent build
                raise
    if announce:
        _announce(target, built=True)
    return target


def _announce(path: Path, *, built: bool) -> None:
    verb = "Built" if built else "Using"
    print(
        f"No --model given. {verb} trioserve's built-in default model at {path}.\n"
        "Its weights are RANDOM, so its text is gibberish: pass --model DIR for a real model.",
        file=sys.stderr,
    )
