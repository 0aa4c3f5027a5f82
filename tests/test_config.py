"""Defaults that the config works out from the host."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve import config as config_module
from trioserve.config import ENGINES_ON_HOST_ENV, EngineConfig, cache_dir, cpu_threads_per_worker


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


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": "4"}, "max_num_seqs: must be an integer (got str '4')"),
        ({"max_num_seqs": None}, "max_num_seqs: must be an integer (got NoneType None)"),
        ({"data_parallel_size": 2.0}, "data_parallel_size: must be an integer (got float 2.0)"),
        ({"block_size": True}, "block_size: must be an integer (got bool True)"),
        ({"max_waiting_requests": float("inf")}, "max_waiting_requests: must be an integer (got float inf)"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching: must be True or False (got int 1)"),
        ({"shutdown_grace_s": "3"}, "shutdown_grace_s: must be a number (got str '3')"),
        ({"fake": {"step_delay_s": 1}}, "fake: must be a FakeRunnerConfig"),
        ({"kv_cache_memory_bytes": 10**30}, "kv_cache_memory_bytes: must be at most 9223372036854775807"),
        ({"max_num_seqs": 10**5000}, "max_num_seqs: must be at most 9223372036854775807"),
    ],
)
def test_a_value_of_the_wrong_type_or_too_big_to_send_is_refused_naming_its_field(
    options: dict[str, object], message: str
) -> None:
    """Before, a string failed a range check with a TypeError naming nothing,
    and a float or a huge integer passed, to crash the engine-core process
    that could not decode it."""
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", **options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_a_path_is_a_model_directory_and_numbers_of_either_kind_are_seconds() -> None:
    import pathlib

    config = EngineConfig(model=pathlib.Path("/models/m"), shutdown_grace_s=3)  # type: ignore[arg-type]
    assert config.model == "/models/m" and config.shutdown_grace_s == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"heartbeat_interval_s": float("inf")}, "heartbeat_interval_s: must be at most 1e+09 (a finite number)"),
        ({"startup_timeout_s": 1e308}, "startup_timeout_s: must be at most 1e+09"),
        ({"step_timeout_s": float("inf")}, "step_timeout_s: must be at most 1e+09"),
        ({"torch_threads": 10**18}, "torch_threads: must be in [1, 4096]"),
    ],
)
def test_times_are_finite_and_threads_bounded(options: dict[str, object], message: str) -> None:
    """Found: an infinite heartbeat interval passed, then killed the worker's
    heartbeat thread (timestamp out of range); 10**18 torch threads failed
    only after the model loaded, with "Overflow when unpacking long"."""
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", **options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_message_bytes": 10**21}, "max_message_bytes: must be at most 9223372036854775807"),
        ({"max_connections": "10"}, "max_connections: must be an integer (got str '10')"),
    ],
)
def test_server_settings_are_checked_for_type_and_size_like_the_engines(
    options: dict[str, object], message: str
) -> None:
    """Found: --max-message-bytes 10**21 with several API servers failed in
    msgpack, a 65-line traceback."""
    from trioserve.server import ServerConfig

    with pytest.raises(ValueError) as info:
        ServerConfig(**options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_the_cache_directory_ignores_a_relative_xdg_cache_home(monkeypatch, tmp_path):
    """Found: ``XDG_CACHE_HOME=relative/dir`` put a 517 MB model under the
    working directory; the XDG spec says to ignore a relative value."""
    monkeypatch.delenv("TRIOSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert cache_dir() == tmp_path / ".cache" / "trioserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trioserve"
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", "ours")
    assert cache_dir() == Path("ours")


def test_threads_from_omp_num_threads_are_capped_as_torch_threads_are(monkeypatch):
    """Found: ``OMP_NUM_THREADS=100000`` made each worker fail to start a thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert cpu_threads_per_worker(EngineConfig(model="m")) == config_module.MAX_TORCH_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_worker(EngineConfig(model="m")) == 3
