"""Shared fixtures: tiny random-weight models, written once per test session."""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable

import pytest
from helpers.fakes import make_fake_config

from trioserve import EngineConfig


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., pathlib.Path]:
    """``tiny_model_dir(arch="llama", seed=0) -> Path``: a tiny model directory
    (weights, config, tokenizer) of that architecture, written on first use
    and shared by the whole session. Architectures: see
    ``trioserve.gpu.tiny_models.ARCHITECTURES``."""
    cache: dict[tuple[str, int], pathlib.Path] = {}

    def get(arch: str = "llama", seed: int = 0) -> pathlib.Path:
        if (arch, seed) not in cache:
            from trioserve.gpu.tiny_models import write_tiny_model

            out = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}")
            cache[arch, seed] = write_tiny_model(out, arch, seed=seed)
        return cache[arch, seed]

    return get


@pytest.fixture
def fake_config(tiny_model_dir: Callable[..., pathlib.Path]) -> Callable[..., EngineConfig]:
    """``fake_config(**options) -> EngineConfig``: an engine on the fake
    runner over the tiny llama's tokenizer (``helpers.fakes.make_fake_config``)."""
    return functools.partial(make_fake_config, str(tiny_model_dir("llama")))
