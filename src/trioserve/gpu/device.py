"""The device and dtype a worker runs on, from the config's names; the memory it has free."""

from __future__ import annotations

import torch

from trioserve.gpu.cpu_kernels.host_memory import available_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def accelerator_index(local_engine_index: int, rank: int, tensor_parallel_size: int, device_count: int) -> int:
    """The accelerator of rank ``rank`` of the engine core at place
    ``local_engine_index`` on its host: engine core i holds devices
    ``[i * TP, (i + 1) * TP)``, its rank r the r-th of them. A ``ValueError``
    names what does not fit when the host has too few devices."""
    index = local_engine_index * tensor_parallel_size + rank
    if index >= device_count:
        needed = (local_engine_index + 1) * tensor_parallel_size
        raise ValueError(
            f"device: engine core {local_engine_index} of this host (rank {rank}) needs device {index}, "
            f"but torch sees {device_count}: {needed} are needed for {local_engine_index + 1} engine core(s) "
            f"of tensor_parallel_size={tensor_parallel_size} here (lower data_parallel_size_local, or the "
            "tensor-parallel size)"
        )
    return index


def resolve_device(
    name: str, rank: int = 0, local_engine_index: int = 0, tensor_parallel_size: int = 1
) -> torch.device:
    """``"auto"`` is CUDA when there is one, else the CPU. On CUDA, rank r
    of the host's i-th engine core uses device ``i * tensor_parallel_size +
    r`` (``accelerator_index``), and makes it its current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if name == "cuda":
        index = accelerator_index(local_engine_index, rank, tensor_parallel_size, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def available_memory(device: torch.device) -> int:
    """Bytes of memory available for new allocations on ``device`` now (on
    the CPU, the host's: what it can give without swapping)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_bytes()
