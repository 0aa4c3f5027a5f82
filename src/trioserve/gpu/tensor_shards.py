"""What tensor parallelism gave this rank of a layer: its weight is a
sharded ``DTensor`` (transformers' plan, ``gpu/sharding.py``), of which the
rank holds a share of the output channels (column-parallel) or of the
inputs (row-parallel)."""

from __future__ import annotations

import torch


def split_of(module: torch.nn.Module) -> tuple[str, slice]:
    """How tensor parallelism split a layer (its weight a sharded ``DTensor``):
    ``("col", this rank's outputs)``, ``("row", this rank's inputs)``, or
    ``("", all)``. Shares as ``torch.chunk`` cuts them (the last may be shorter)."""
    weight = getattr(module, "weight", None)
    placements = getattr(weight, "placements", None)
    if weight is None or not placements or not placements[0].is_shard():
        return "", slice(None)
    dim = placements[0].dim % 2  # Shard(0): the output features; Shard(1) or Shard(-1): the inputs
    mesh = weight.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    chunks = torch.arange(weight.shape[dim]).chunk(size)
    start = sum(len(c) for c in chunks[:rank])
    return ("col" if dim == 0 else "row"), slice(start, start + len(chunks[rank]))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a sharded ``DTensor``), or itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
