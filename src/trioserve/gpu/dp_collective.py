"""The transformers runner's data-parallel collective: an all-reduce over
torch.distributed (gloo), in a process group of its own (the default one,
if any, is tensor parallelism's): one rank per engine core, the output rank
of its workers. Rendezvous through a file store in the front-end's private
directory, one per generation of the group; nothing listens beyond this
machine."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore

TIMEOUT = datetime.timedelta(hours=1)  # the engine's own step deadlines come first


class GlooAnyOf:
    """``any_of(flag)``: True when any rank's ``flag`` is True."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._store = FileStore(path, size)
        # torch's stubs lack the backend's collectives: the group is typed by what we call.
        self._group: Any = dist.ProcessGroupGloo(self._store, rank, size, TIMEOUT)

    def any_of(self, flag: bool) -> bool:
        """Block until every rank joined this step; the OR of their flags."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._group.allreduce([value]).wait()
        return bool(value.item())

    def close(self) -> None:
        """Nothing to release by hand: the group goes with the process."""
