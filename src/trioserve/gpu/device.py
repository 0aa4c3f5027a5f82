"""The device and dtype a worker runs on, from the config's names; the memory it has free."""

from __future__ import annotations

import torch

from trioserve.gpu.cpu_kernels.host_memory import available_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """``"auto"`` is CUDA when there is one, else the CPU. With tensor
    parallelism (``rank`` given), rank r uses CUDA device r."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if name == "cuda" and rank is not None:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
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
