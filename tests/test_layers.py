"""The layers keep to their imports (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trioserve

SRC = Path(trioserve.__file__).parent

# For each layer: the top-level packages its modules may import at module level.
STDLIB = set(sys.stdlib_module_names)
ALLOWED = {
    "core": STDLIB | {"msgspec", "trioserve.messages", "trioserve.config", "trioserve.core"},
    "nurseries": STDLIB | {"msgspec", "trio", "zmq", "trioserve"},
    "frontend": STDLIB | {"msgspec", "trio", "zmq", "tokenizers", "trioserve"},
    "server": STDLIB | {"msgspec", "trio", "trio_websocket", "trioserve"},
    "bench": STDLIB | {"msgspec", "trio", "trio_websocket", "psutil", "trioserve"},
}
FORBIDDEN_EVERYWHERE_BUT_GPU = ("torch", "transformers", "trioserve.gpu")


def module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def allowed(name: str, allowed_names: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed_names) or name == "__future__"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_it_may(layer):
    for path in sorted((SRC / layer).glob("*.py")):
        for name in module_level_imports(path):
            assert allowed(name, ALLOWED[layer]), f"{path.name} imports {name}"
            assert not name.startswith(FORBIDDEN_EVERYWHERE_BUT_GPU), f"{path.name} imports {name}"


def test_front_end_and_cli_import_neither_torch_nor_transformers():
    code = (
        "import sys, trioserve, trioserve.cli, trioserve.nurseries.engine_core, trioserve.nurseries.worker; "
        "bad = [m for m in ('torch', 'transformers', 'trioserve.gpu') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
