"""Which accelerators each data-parallel engine core's workers use (``gpu/device.py``), as a unit: no GPU here."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from trioserve.gpu.device import accelerator_index
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.launch import EngineCoreLaunch
from trioserve.nurseries.headless.main import HeadlessConfig, engine_launch


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_engine_core_of_a_host_holds_its_own_block_of_devices(tp):
    engines = 8 // tp
    devices = {
        (engine, rank): accelerator_index(engine, rank, tp, device_count=8)
        for engine in range(engines)
        for rank in range(tp)
    }
    for (engine, rank), index in devices.items():
        assert engine * tp <= index < (engine + 1) * tp
        assert index == engine * tp + rank
    assert sorted(devices.values()) == list(range(8))  # every device once: no two workers share one


def test_a_host_with_too_few_devices_is_refused_naming_the_device_it_lacks():
    assert accelerator_index(1, 1, 2, device_count=4) == 3
    with pytest.raises(ValueError, match=r"engine core 2 of this host \(rank 0\) needs device 4, but torch sees 4"):
        accelerator_index(2, 0, 2, device_count=4)


def test_a_headless_hosts_engine_cores_count_their_place_from_its_start_rank():
    config = HeadlessConfig(start_rank=2, num_engines=2, address="10.0.0.1", rpc_port=5555, insecure_tcp=True)
    launches = [engine_launch(config, rank) for rank in config.ranks]
    assert [launch.engine_index for launch in launches] == [2, 3]
    assert [launch.local_engine_index for launch in launches] == [0, 1]  # devices [0, TP) and [TP, 2 TP)
    assert [EngineCoreLaunch.from_env(launch.env({})).local_engine_index for launch in launches] == [0, 1]
    head = EngineCoreLaunch(handshake_address="ipc:///run/handshake", engine_index=1)
    assert EngineCoreLaunch.from_env(head.env({})).local_engine_index == 1  # on the head: its engine index


def test_the_executor_tells_every_worker_its_engine_cores_place_on_the_host(fake_config):
    config = fake_config(tensor_parallel_size=2)
    inits = [Executor(config, engine_index=3, local_engine_index=1).worker_init(r, 2, "") for r in range(2)]
    assert [(i.engine_index, i.local_engine_index, i.rank) for i in inits] == [(3, 1, 0), (3, 1, 1)]
    assert [accelerator_index(i.local_engine_index, i.rank, i.world_size, 4) for i in inits] == [2, 3]
    head = Executor(config, engine_index=2).worker_init(0, 2, "")
    assert head.local_engine_index == 2  # on the head, its engine index


def test_a_tensor_parallel_group_talks_over_nccl_on_cuda_and_gloo_on_the_cpu():
    import torch

    from trioserve.gpu.sharding import process_group_backend

    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"
