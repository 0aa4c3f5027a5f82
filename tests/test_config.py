"""Defaults that the config works out from the host."""

from __future__ import annotations

import pytest

from trioserve import config as config_module
from trioserve.config import ENGINES_ON_HOST_ENV, EngineConfig, cpu_threads_per_worker


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An 8-core host with no thread settings in the environment."""
    monkeypatch.setattr(config_module, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(ENGINES_ON_HOST_ENV, raising=False)
    return monkeypatch


def test_one_worker_gets_every_core(host: pytest.MonkeyPatch) -> None:
    assert cpu_threads_per_worker(EngineConfig(model="m")) == 8


def test_workers_on_one_host_share_its_cores(host: pytest.MonkeyPatch) -> None:
    assert cpu_threads_per_worker(EngineConfig(model="m", tensor_parallel_size=2)) == 4
    assert cpu_threads_per_worker(EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2)) == 2
    assert cpu_threads_per_worker(EngineConfig(model="m", tensor_parallel_size=4, data_parallel_size=4)) == 1
    # Engine cores on other hosts take none of this host's cores...
    remote = EngineConfig(
        model="m", data_parallel_size=4, data_parallel_size_local=1, data_parallel_rpc_port=9, insecure_tcp=True
    )
    assert cpu_threads_per_worker(remote) == 8
    # ...and a headless host says how many of them it runs (the head's config cannot).
    host.setenv(ENGINES_ON_HOST_ENV, "3")
    assert cpu_threads_per_worker(remote) == 2


def test_what_the_operator_says_wins(host: pytest.MonkeyPatch) -> None:
    host.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_worker(EngineConfig(model="m")) == 3
    assert cpu_threads_per_worker(EngineConfig(model="m", torch_threads=5)) == 5
    host.setenv("OMP_NUM_THREADS", "lots")  # not a count: ignored
    assert cpu_threads_per_worker(EngineConfig(model="m")) == 8
