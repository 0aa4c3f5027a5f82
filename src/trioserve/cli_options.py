"""Command-line options that every command running an engine shares
(``trioserve serve``, ``generate``, ``chat`` and ``bench``), written once."""

from __future__ import annotations

import argparse


def add_parallel_options(group: argparse._ArgumentGroup) -> None:
    """``--data-parallel-size``, ``--tensor-parallel-size``, ``--data-parallel-lockstep``."""
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine cores side by side, each with its own workers; new requests go to the least loaded "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="worker processes per engine core, each holding a shard of the model (Llama, Qwen2, Qwen3 and "
        "other architectures with a tensor-parallel plan in transformers; default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-lockstep",
        action="store_true",
        help="step every engine core while any has work (the idle ones with dummy steps), as models whose "
        "data-parallel ranks share collectives need",
    )


def add_compile_option(group: argparse._ArgumentGroup, *, default: bool) -> None:
    """``--compile`` / ``--no-compile``: ``EngineConfig.compile``."""
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="torch.compile the model in each worker before the engine reports ready (not with tensor "
        "parallelism); a model's first start compiles for a minute or more, later starts take seconds from the "
        "cache in ~/.cache/trioserve/inductor (default: %(default)s)",
    )


THREADS_HELP = (
    "torch intra-op threads in each worker on the CPU (default: OMP_NUM_THREADS if set, else the cores this "
    "process may use shared out among the workers on this host)"
)


def add_threads_option(group: argparse._ArgumentGroup, *, help: str = THREADS_HELP) -> None:
    """``--torch-threads N``: ``EngineConfig.torch_threads``."""
    group.add_argument("--torch-threads", type=int, default=None, metavar="N", help=help)
