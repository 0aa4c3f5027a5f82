"""The layers keep to their imports (docs/architecture.md, "Layers").

Every unit of the package (a subpackage, or a top-level module) has a rank.
An import of another unit, at module level or inside a function, must go to
a lower rank: nothing runs back up, and units of the same rank do not import
each other. torch and transformers (and ``trioserve.gpu``, which imports
them) are imported at module level only by ``gpu/`` and by the benchmark's
baseline process (``bench/baselines.py``); lazily, only by the worker's
choice of runner and the benchmark's model-building subprocess.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trioserve

SRC = Path(trioserve.__file__).parent

RANKS = {
    "errors": 0,
    "checks": 0.5,  # a request's values checked, naming the field (SamplingParams' building blocks; uses errors)
    "config": 0.2,  # the engine's config (uses lora, to read --lora-modules)
    "lora": 0,  # LoRA adapters' names and configs (PEFT's format), without torch
    "rpc": 0,  # the control calls: a closed union that messages carries
    "byte_level": 0,  # the byte-level vocabularies' alphabet (the front-end's tokenizer, the tiny models)
    "stdio": 0,  # a process's standard descriptors, and lines said on them
    "structured": 0,  # structured-output constraints, as SamplingParams carries them
    "pooling": 0.6,  # an embedding request's pooling, as SamplingParams carries it (uses checks, errors)
    "sampling_params": 0.7,  # SamplingParams and its bounds (uses checks, errors, structured)
    "messages": 1,
    "core": 2,
    "transport": 3,
    "runners": 3,
    "gpu": 4,
    "nurseries": 5,
    "frontend": 6,
    "default_model": 6,
    "api": 7,
    "engine_options": 7,  # the engine's options and config, shared by the CLI's commands and the benchmark
    "model_source": 7,  # where a named model is (a directory, a .gguf file, a Hugging Face id): CLI and benchmark
    "server": 8,
    "bench": 8,
    "chat": 8,
    "cli": 9,
    "__init__": 10,  # the public face re-exports from anywhere
}

STDLIB = set(sys.stdlib_module_names) | {"__future__"}
TORCH = {"torch", "transformers", "safetensors", "trioserve.gpu"}
# Third-party packages each unit may import (anywhere in its modules).
THIRD_PARTY = {
    "errors": {"trio"},  # lazily: to tell a cancellation from a failure
    "checks": set(),
    "config": set(),
    "lora": set(),
    "byte_level": set(),
    "stdio": set(),
    "structured": {"msgspec"},
    "pooling": {"msgspec"},
    "rpc": {"msgspec"},
    "sampling_params": {"msgspec"},
    "messages": {"msgspec"},
    "core": {"msgspec"},
    "transport": {"msgspec", "trio", "zmq"},
    "runners": {"msgspec", "trio"},
    # gguf: the default model's file, read by transformers and made once per conversion (gpu/gguf_convert.py).
    # triton: the CUDA path's attention kernels (gpu/triton_attention.py, imported only where they run).
    "gpu": {"msgspec", "torch", "transformers", "safetensors", "tokenizers", "numpy", "gguf", "triton"},
    # llguidance (and numpy, its bitmask arrays): the engine core's grammars (nurseries/engine_core/grammar.py).
    "nurseries": {"msgspec", "trio", "zmq", "setproctitle", "llguidance", "numpy"},
    # jinja2: the model's chat template, rendered in a sandbox (frontend/text/chat_template.py).
    # llguidance: a request's constraint checked before it goes to an engine (frontend/text/structured.py).
    # ray: engine cores placed by Ray (frontend/engines/ray_backend.py, imported there lazily).
    "frontend": {"msgspec", "trio", "zmq", "tokenizers", "jinja2", "llguidance", "ray"},
    "default_model": set(),
    "api": {"msgspec", "trio"},
    # h11: HTTP/1.1 framing (server/http_conn.py); prometheus_client: /metrics (server/metrics.py).
    "server": {"msgspec", "trio", "trio_websocket", "h11", "prometheus_client"},
    # h11: the OpenAI API's HTTP client (bench/openai_driver.py).
    # sentence_transformers: the embedding benchmark's baseline (bench/st_baseline.py, a child process).
    "bench": {"msgspec", "trio", "trio_websocket", "psutil", "matplotlib", "numpy", "h11", "sentence_transformers"},
    "chat": {"trio"},
    "engine_options": set(),
    "cli": {"msgspec", "trio"},
    # huggingface_hub: a model given as a Hugging Face id, found in the local cache.
    "model_source": {"huggingface_hub"},
    "__init__": set(),
}
# (module, imported unit) pairs allowed although they break the rules above.
TORCH_AT_MODULE_LEVEL = {"bench/baselines.py", "bench/st_baseline.py"}
# Modules run by another project's interpreter: they import only the standard
# library and that project (never trioserve, which is not installed there).
OTHER_INTERPRETERS = {"bench/vllm_driver.py": "vllm"}
LAZY_GPU_IMPORTS = {
    ("nurseries/worker/main.py", "trioserve.gpu.model_runner"),  # the worker's runner
    ("nurseries/worker/main.py", "trioserve.gpu.dp_collective"),  # its data-parallel collective
    ("bench/models.py", "transformers.utils"),  # the model-building subprocess
    ("bench/models.py", "trioserve.gpu.tiny_models"),
}


def unit_of(relpath: str) -> str:
    first = relpath.split("/", maxsplit=1)[0]
    return first.removesuffix(".py")


def imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """Every absolute import in ``tree``: (module name, at module level?)."""
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, id(node) in top))
    return found


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(relpath: str, source: str) -> list[str]:
    """What is wrong with the imports of the module at ``relpath`` (under
    ``src/trioserve``) whose text is ``source``."""
    unit = unit_of(relpath)
    problems = []
    if relpath in OTHER_INTERPRETERS:
        allowed = STDLIB | {OTHER_INTERPRETERS[relpath]}
        names = [name for name, _ in imports(ast.parse(source))]
        return [
            f"{relpath} imports {n}, but runs in another interpreter" for n in names if n.split(".")[0] not in allowed
        ]
    for name, module_level in imports(ast.parse(source)):
        if any(_is(name, t) for t in TORCH):
            if module_level and unit != "gpu" and relpath not in TORCH_AT_MODULE_LEVEL:
                problems.append(f"{relpath} imports {name} at module level")
                continue
            lazy_allowed = unit == "gpu" or relpath in TORCH_AT_MODULE_LEVEL or (relpath, name) in LAZY_GPU_IMPORTS
            if not module_level and not lazy_allowed:
                problems.append(f"{relpath} imports {name} (torch belongs to worker and baseline processes)")
                continue
        if _is(name, "trioserve"):
            parts = name.split(".")
            target = parts[1] if len(parts) > 1 else "__init__"
            if target not in RANKS:
                problems.append(f"{relpath} imports {name}: unit {target!r} has no rank")
            elif target != unit and RANKS[target] >= RANKS[unit]:
                problems.append(
                    f"{relpath} imports {name}: {unit} (rank {RANKS[unit]}) may not import "
                    f"{target} (rank {RANKS[target]})"
                )
        elif name.split(".")[0] not in STDLIB and not any(_is(name, t) for t in TORCH):
            allowed = THIRD_PARTY[unit]
            if name.split(".")[0] not in allowed:
                problems.append(f"{relpath} imports {name}, which {unit} may not use")
    return problems


def all_modules() -> list[str]:
    return sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py"))


def test_every_unit_has_a_rank():
    assert {unit_of(m) for m in all_modules()} <= set(RANKS)


@pytest.mark.parametrize("relpath", all_modules())
def test_imports_never_run_back_up(relpath):
    assert violations(relpath, (SRC / relpath).read_text()) == []


@pytest.mark.parametrize(
    ("relpath", "source", "expected"),
    [
        ("gpu/model_runner.py", "from trioserve.bench.stats import percentile\n", "gpu (rank 4) may not import bench"),
        ("core/scheduler.py", "def f():\n    import trioserve.frontend\n", "core (rank 2) may not import frontend"),
        ("transport/framing.py", "from trioserve.runners import Runner\n", "transport (rank 3) may not import runners"),
        ("frontend/engines/client.py", "import torch\n", "imports torch at module level"),
        ("server/http.py", "def f():\n    from trioserve.gpu import sampler\n", "torch belongs to worker"),
        ("core/request.py", "import trio\n", "which core may not use"),
    ],
)
def test_the_check_finds_an_import_that_breaks_the_layers(relpath, source, expected):
    found = violations(relpath, source)
    assert len(found) == 1 and expected in found[0], found


def test_front_end_and_cli_import_neither_torch_nor_transformers():
    code = (
        "import sys, trioserve, trioserve.cli, trioserve.server, trioserve.bench.cli, "
        "trioserve.nurseries.engine_core.main, trioserve.nurseries.worker.main; "
        "bad = [m for m in ('torch', 'transformers', 'trioserve.gpu') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def module_name(relpath: str) -> str:
    """``frontend/engines/client.py`` -> ``trioserve.frontend.engines.client`` (a package's ``__init__.py`` is
    the package)."""
    parts = ["trioserve", *relpath.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, at module level or inside functions: ``from P import N``
    counts as an import of ``P.N`` when that is a module, else of ``P``."""
    modules = {module_name(relpath) for relpath in sources}
    graph: dict[str, set[str]] = {}
    for relpath, source in sources.items():
        edges = graph.setdefault(module_name(relpath), set())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    edges.add(name if name in modules else node.module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of more than one module, and each module that
    imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1 or module in graph.get(module, ()):
                found.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_takes_part_in_an_import_circle():
    sources = {relpath: (SRC / relpath).read_text() for relpath in all_modules()}
    assert circles(import_graph(sources)) == []


def test_the_circle_check_finds_a_planted_circle_inside_a_function():
    sources = {relpath: (SRC / relpath).read_text() for relpath in all_modules()}
    assert circles(import_graph(sources)) == []
    sources["core/invariants.py"] += "\n\ndef planted():\n    from trioserve.core import scheduler\n"
    found = circles(import_graph(sources))
    assert any({"trioserve.core.invariants", "trioserve.core.scheduler"} <= set(c) for c in found), found
