"""Shared fixtures: tiny random-weight models, written once per test session;
and the guard that no test leaves a private directory behind."""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
from helpers.fakes import make_fake_config
from hypothesis import settings

from trioserve import EngineConfig

# Hypothesis keeps no example database here: with one, it also keeps the
# Pareto front of every test's target() scores, which cost the scheduler's
# state machine more time than its examples do (CI starts from a clean checkout,
# so the database never had anything to replay there). A failure prints the
# blob that reproduces it (@reproduce_failure).
settings.register_profile("trioserve", database=None, print_blob=True)
settings.load_profile("trioserve")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., pathlib.Path]:
    """``tiny_model_dir(arch="llama", seed=0) -> Path``: a tiny model directory
    (weights, config, tokenizer) of that architecture, written on first use
    and shared by the whole session: by every test process of it (xdist's
    workers share their base directory's parent), the first to ask writing
    it under a lock, so that a process whose tests only need the tokenizer
    never imports torch to write one. Read-only for the tests.
    Architectures: see ``trioserve.gpu.tiny_models.ARCHITECTURES``."""
    import filelock

    cache: dict[tuple[str, int], pathlib.Path] = {}
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(arch: str = "llama", seed: int = 0) -> pathlib.Path:
        if (arch, seed) not in cache:
            out, written = shared / f"tiny-{arch}-{seed}", shared / f"tiny-{arch}-{seed}.written"
            with filelock.FileLock(str(out) + ".lock"):
                if not written.exists():
                    from trioserve.gpu.tiny_models import write_tiny_model

                    shutil.rmtree(out, ignore_errors=True)  # (a writer that died half-way)
                    out.mkdir()
                    assert write_tiny_model(out, arch, seed=seed) == out
                    written.touch()
            cache[arch, seed] = out
        return cache[arch, seed]

    return get


@pytest.fixture
def fake_config(
    tiny_model_dir: Callable[..., pathlib.Path], request: pytest.FixtureRequest
) -> Callable[..., EngineConfig]:
    """``fake_config(**options) -> EngineConfig``: an engine on the fake
    runner over the tiny llama's tokenizer (``helpers.fakes.make_fake_config``).
    A test, or a module (``pytestmark``), marked ``fake_config(**defaults)``
    gets those defaults (the closest mark's); the call's options win."""
    mark = request.node.get_closest_marker("fake_config")
    defaults = mark.kwargs if mark is not None else {}
    return functools.partial(make_fake_config, str(tiny_model_dir("llama")), **defaults)


# --- no private directory left behind ----------------------------------------
#
# Every engine, API server and lockstep group makes private directories
# (``trioserve-*``) under the temporary directory, and must remove them however
# it ends (kill -9 of a parent included: ``remove_if_parent_dies``). Each test
# process (the one pytest process, or each xdist worker) gets a temporary
# directory of its own, which its children inherit through ``TMPDIR``, so that
# what is left there is this process's tests' doing and no other's.

LEAK_WAIT_S = 5.0  # a process that is stopping may still be removing its directory

# --- how many test processes ---------------------------------------------------
#
# ``-n logical`` (pyproject's addopts) asks this hook: one test process per CPU
# and one more. A test spends about a third of its time waiting on its
# processes (starts, grace periods, timeouts), so with one process per CPU the
# CPUs idled a quarter of the run (484 CPU-s in 324 s on 2 CPUs). Measured on 2 CPUs, back to back, 970
# tests: 2 processes 322 s, 3 processes 273 s, 4 processes 269 s.
# PYTEST_XDIST_AUTO_NUM_WORKERS still decides when it is set.


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return None  # xdist's own hook reads it
    return len(os.sched_getaffinity(0)) + 1


def pytest_configure(config: pytest.Config) -> None:
    # The suite runs a test process per core (and one more), so each engine's worker takes one
    # torch thread (the default on a bare host is its cores shared among its workers).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Without a GPU, Triton's interpreter runs the CUDA path's kernels (tests/test_gpu_triton_attention.py). It must be
    # on before triton.language is first imported (its own functions, tl.zeros and the like, are made then), and
    # torch imports it while other test modules are collected; NVIDIA's driver device is the sign of a GPU here
    # (torch, which would say, is too slow to import in every test process).
    if not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest's own tmp_path stays where it was (short paths: ipc:// socket names are limited to ~107 bytes).
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    own = tempfile.mkdtemp(prefix=f"ts{worker}-")  # the xdist workers' come inside the controller's
    os.environ["TMPDIR"] = own
    tempfile.tempdir = own
    config.add_cleanup(functools.partial(shutil.rmtree, own, ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped where torch sees no CUDA device (torch
    is imported only when such a test was collected), unless
    ``TRIOSERVE_CUDA_TESTS_DEVICE=cpu`` runs them on the CPU instead (their
    device comes from it: tests/test_cuda.py), so that their code is checked
    on a machine without a GPU."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked or os.environ.get("TRIOSERVE_CUDA_TESTS_DEVICE") == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these on one)")
    for item in marked:
        item.add_marker(skip)


def _private_dirs() -> set[str]:
    return {entry.name for entry in os.scandir(tempfile.gettempdir()) if entry.name.startswith("trioserve-")}


_made_by: dict[str, str] = {}  # a private directory still there after its test -> that test


@pytest.fixture(autouse=True)
def _note_private_directories(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _private_dirs()
    yield
    for name in _private_dirs() - before:  # a shared engine's may outlive the test: judged at the end
        _made_by.setdefault(name, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _no_private_directory_left() -> Iterator[None]:
    """After the last test (and every shared engine) of this process: no
    ``trioserve-*`` directory remains."""
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while (left := _private_dirs()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, "private directories left behind: " + "; ".join(
        f"{name} (after {_made_by.get(name, 'an unknown test')})" for name in sorted(left)
    )
    shutil.rmtree(tempfile.gettempdir(), ignore_errors=True)  # what else libraries put there (torch's caches)
