"""Our C++ kernels for the CPU, built with inductor's own toolchain and
loaded through an index of ours.

A kernel is one ``extern "C" void kernel(...)`` in a source string, built by
inductor (``CppPythonBindingsCodeCache``: its compiler flags, torch's headers
with ``at::vec`` vectors, OpenMP) into a library in inductor's cache
(``compiled.inductor_cache_dir()``): seconds the first time on a machine.
Inductor's own lookup of a built library checks the compiler and the vector
ISA again in every process (about 0.8 s, in subprocesses), so the path of the
library it loaded is also kept in a small index of ours, keyed by the source,
the argument types, torch, Python and the CPU's vector capability; a later
process loads the library straight from it (about 0.1 s). Users:
``attention.py`` (decode attention), ``linear.py`` (the float GEMM),
``int8.py`` (the int8 GEMM), ``lora.py`` and ``fused.py`` (RMSNorm and
SiLU x up).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from trioserve.gpu.compiled import inductor_cache_dir

log = logging.getLogger(__name__)

# The C++ type our kernels are built with for each dtype they take (one library per dtype).
CPP_SCALARS = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}


def index_path(name: str, source: str, argtypes: list[str], simdlen: int | None = None) -> Path:
    """The index entry of kernel ``name`` built from this source for this torch, Python and CPU (and vector
    width, where one is asked for)."""
    identity = "\0".join(
        [source, repr(argtypes), torch.__version__, sys.version, platform.machine(),
         torch.backends.cpu.get_cpu_capability(), str(simdlen)]
    )  # fmt: skip
    return inductor_cache_dir() / "trioserve" / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def load_or_build(name: str, source: str, argtypes: list[str], simdlen: int | None = None) -> Callable[..., None]:
    """Kernel ``name`` from the library our index names; else built (or found)
    by inductor, and the library it loaded written to the index. Raises what
    the build raises (no compiler, say): callers fall back to a portable path.
    ``simdlen`` (256, say) builds for the first vector ISA of that width this
    CPU runs (AVX2 on an AVX-512 host: how the tests build both), not the
    widest."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    index = index_path(name, source, argtypes, simdlen)
    try:
        entry = json.loads(index.read_text())
        if Path(entry["path"]).is_file():
            return getattr(Bindings._load_library_inner(entry["path"], entry["key"]), Bindings.entry_function)
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.info("%s kernel: index %s unusable (%s); building", name, index, exc)
    with inductor_config.patch({"cpp.simdlen": simdlen}):
        kernel = Bindings.load_pybinding(argtypes, source)
    for module_name in Bindings._loaded_module_names:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, Bindings.entry_function, None) is kernel and module.__file__:
            try:
                index.parent.mkdir(parents=True, exist_ok=True)
                partial = index.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps({"path": module.__file__, "key": module_name.rsplit(".", 1)[0]}))
                partial.replace(index)  # atomic: another process may be reading it
            except OSError as exc:  # a read-only cache: the next process asks inductor again
                log.info("%s kernel: could not write the index %s (%s)", name, index, exc)
            break
    return kernel
