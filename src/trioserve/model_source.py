"""Where a model named on a command line is: a local model directory, a
``.gguf`` file (converted once into the cache, as the default model is), or
a Hugging Face id (``org/name``), found in the local Hugging Face cache
(``$HF_HOME``, ``$HF_HUB_CACHE``, or ``--download-dir``) and used as it is
there; one not in the cache is downloaded unless ``HF_HUB_OFFLINE=1``. With
no model, the built-in default one. ``serve``, ``generate``, ``chat`` and
``bench`` take their model through here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

from trioserve.errors import EngineStartupError
from trioserve.nurseries.supervision.process import describe_exit

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The model directory ``name`` stands for (see the module's docstring);
    a start-up error (exit 3) naming it when it cannot be had."""
    path = Path(name)
    if path.is_dir():
        return os.path.abspath(path)  # a child started after a deploy removed the working directory needs it whole
    if path.is_file() and path.suffix == ".gguf":
        return _built(lambda: _gguf_dir(path), f"converting {name}")
    if not path.exists() and HUB_ID.fullmatch(name):
        return _from_hub(name, revision, download_dir)
    return name  # the engine's check names what is wrong with it


def _gguf_dir(path: Path) -> str:
    from trioserve.default_model import gguf_model_dir

    return str(gguf_model_dir(path))


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The snapshot of ``repo_id`` in the local Hugging Face cache, else
    downloaded (unless offline)."""
    from huggingface_hub import constants, snapshot_download

    cache = download_dir or constants.HF_HUB_CACHE
    try:
        return str(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception as exc:  # not in the cache (huggingface_hub raises several kinds)
        missing: Exception = exc
    if constants.HF_HUB_OFFLINE:
        raise EngineStartupError(
            f"{repo_id!r}{_at(revision)} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: "
            f"download it there first, or give a model directory ({type(missing).__name__})",
            stage="model-load",
        )
    try:
        return str(snapshot_download(repo_id, revision=revision, cache_dir=download_dir))
    except Exception as exc:  # no network, no such repository, no access: one line naming it
        raise EngineStartupError(
            f"{repo_id!r}{_at(revision)} is not in the Hugging Face cache {cache}, and downloading it failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            stage="model-load",
        ) from None


def _at(revision: str | None) -> str:
    return "" if revision is None else f" at revision {revision!r}"


def default_model() -> str:
    """The built-in default model's directory, converted on first use; a
    failure (its package missing, the cache directory unusable, the
    conversion failing) is a start-up error (exit 3) saying what to do."""
    from trioserve.default_model import default_model_dir

    return _built(lambda: str(default_model_dir()), "converting the default model")


def _built(build: Any, doing: str) -> str:
    try:
        return build()  # type: ignore[no-any-return]
    except OSError as exc:
        raise EngineStartupError(str(exc), stage="model-load") from None
    except subprocess.CalledProcessError as exc:
        why = "its error is above" if exc.returncode > 0 else f"the converter {describe_exit(exc.returncode)}"
        raise EngineStartupError(f"{doing} failed (exit code {exc.returncode}; {why})", stage="model-load") from None
