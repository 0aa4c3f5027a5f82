"""The public API is what docs/embedding.md says it is."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import trioserve

DOCS = Path(__file__).parent.parent / "docs" / "embedding.md"


def documented_names(marker: str = "public-names") -> set[str]:
    text = DOCS.read_text()
    match = re.search(rf"<!-- {marker} -->(.*?)<!-- /{marker} -->", text, re.S)
    assert match, f"docs/embedding.md lists the names between {marker} markers"
    return set(re.findall(r"`([A-Za-z_]+)`", match.group(1)))


def test_public_names_are_the_documented_ones():
    assert documented_names() == set(trioserve.__all__)


def test_the_engines_public_names_are_the_documented_ones_and_each_is_described():
    """What the request streams call back into (checking prompts, building
    and submitting requests) is not part of ``Engine``'s face."""
    public = {name for name in dir(trioserve.Engine) if not name.startswith("_")}
    assert public == documented_names("engine-names")
    text = DOCS.read_text()
    undescribed = [name for name in sorted(public) if f"engine.{name}" not in text]
    assert undescribed == []


def test_every_public_name_is_a_class_or_function_of_trioserve():
    for name in trioserve.__all__:
        obj = getattr(trioserve, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("trioserve."), (name, obj.__module__)
        assert obj.__name__ == name, name


def test_the_lazy_names_are_exactly_the_public_ones_and_those_typed():
    """``trioserve/__init__`` imports its names on first use: its map of where
    each lives, ``__all__`` and the imports it gives type checkers agree."""
    import ast

    tree = ast.parse(Path(trioserve.__file__).read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == trioserve._HOME_OF
    assert sorted(trioserve._HOME_OF) == sorted(trioserve.__all__)


def test_a_child_process_module_does_not_import_the_front_end():
    import subprocess
    import sys

    code = (
        "import sys, trioserve.nurseries.worker.main, trioserve.runners.fake; "
        "print(sorted(m for m in ('trioserve.api', 'trioserve.frontend', 'jinja2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_errors_share_one_base_or_are_value_errors():
    for name in trioserve.__all__:
        obj = getattr(trioserve, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, (trioserve.TrioserveError, ValueError)), name


def test_engines_failing_to_start_at_once_raise_one_startup_error_naming_each():
    # Found: two data-parallel engines that missed their model-load deadline
    # together reached the caller as an ExceptionGroup, not EngineStartupError.
    from trioserve.errors import collapse

    first = trioserve.EngineStartupError(
        "engine-core-0 failed", stage="model-load", process="engine-core-0", exit_code=1
    )
    second = trioserve.EngineStartupError("engine-core-1 failed", stage="handshake", process="engine-core-1")
    both = collapse(ExceptionGroup("start", [first, ExceptionGroup("inner", [second])]))
    assert isinstance(both, trioserve.EngineStartupError)
    assert str(both) == "engine-core-0 failed; engine-core-1 failed"
    assert (both.stage, both.process, both.exit_code) == ("model-load", "engine-core-0", 1)
    assert collapse(ExceptionGroup("one", [second])) is second
    mixed = ExceptionGroup("mixed", [first, RuntimeError("boom")])
    assert collapse(mixed) is mixed  # several different things went wrong: the caller sees them all
