"""Which kernel each linear layer of a model runs on the CPU, chosen at the
worker's start by timing them on this host.

Three kernels can multiply a float32 or bfloat16 layer's rows by its weight:
ours on panels (``"ours"``: ``PanelLinear``), oneDNN's on its blocked layout
(``"onednn"``: ``PackedLinear``, where oneDNN packs the dtype) and MKL's
through ``F.linear`` on the weight as stored (``"mkl"``: the ``nn.Linear``
left as it is). Which is fastest depends on the host (its vector ISA, AMX),
the dtype, the threads, the layer's shape and the row count: on an AVX-512
host at float32, ours leads up to about 128 rows and MKL's from 512 on.

``choose_kernels`` times every candidate on each distinct ``(in, out)``
shape of the model's linears, at two row counts: the decode's
(``max_num_seqs``, the most rows a step of decodes has) and a prefill's
(``max_num_batched_tokens``, at most ``PREFILL_ROWS_CAP``). Each call is
timed after one warm-up, the best of ``TIMED_CALLS`` (the least disturbed
by other tenants), on random weights and rows of the layer's shape. The
current default (ours) keeps a regime unless another kernel is faster by
more than ``MARGIN``. The LM head is timed at the decode's rows only (it
multiplies the sampled rows, never a prompt's). A layer whose two regimes
pick different kernels is a ``SplitLinear`` (``linear.py``): both layouts (its weight held
twice), rows up to the decode count to one kernel, more to the other. That
is done only while the extra copies fit in ``SPLIT_MEMORY_SHARE`` of the
memory available now; past that, a layer keeps its decode pick for all rows.

The choice is cached as JSON in the kernel cache (``cpp.py``'s index
directory), keyed by the CPU (its model name and vector capability), torch,
the dtype, the threads, the shapes and the row counts: a second start of
the same model on the same host times nothing. ``TRIOSERVE_PACKED_LINEAR``
forces one kernel for every layer (``ours``, ``onednn``; ``0``: ``F.linear``
everywhere); ``all`` (the default) is this choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from trioserve.gpu.compiled import inductor_cache_dir

log = logging.getLogger(__name__)

MARGIN = 0.05  # another kernel must be this much faster than the default to be chosen for a regime
PREFILL_ROWS_CAP = 512  # the prefill regime's rows when timing (the rate has levelled off by then)
TIMED_CALLS = 5
SPLIT_MEMORY_SHARE = 0.25  # of the memory available now, at most, for the second layouts of split layers

Shape = tuple[int, int]  # (in_features, out_features)
Choice = dict[str, str]  # {"decode": kind, "prefill": kind}
Factory = Callable[[torch.nn.Linear], Callable[[torch.Tensor], torch.Tensor]]


def cache_path(
    shapes: list[Shape], head_shapes: list[Shape], dtype: torch.dtype, rows: tuple[int, int], kinds: list[str]
) -> Path:
    """The cached choice's file for this host, torch, dtype, threads, shapes, row counts and candidates."""
    identity = json.dumps(
        [_cpu_name(), torch.backends.cpu.get_cpu_capability(), torch.__version__, str(dtype),
         torch.get_num_threads(), shapes, head_shapes, list(rows), kinds]
    )  # fmt: skip
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return inductor_cache_dir() / "trioserve" / f"linear-choice-{digest}.json"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        return ""


def choose_kernels(
    shapes: Iterable[Shape],
    head_shapes: Iterable[Shape],
    dtype: torch.dtype,
    rows: tuple[int, int],
    factories: dict[str, Factory],
    default: str,
) -> dict[Shape, Choice]:
    """Each shape's kernel per regime (the module's docstring), from the cache
    when it has this case, else timed and cached. ``factories``: the
    candidates that can run here, each making a callable from an
    ``nn.Linear``; ``default``: the one kept unless another is faster by
    ``MARGIN``. ``head_shapes``: timed at the decode's rows only."""
    layer_shapes, heads = sorted(set(shapes)), sorted(set(head_shapes))
    path = cache_path(layer_shapes, heads, dtype, rows, sorted(factories))
    try:
        cached = json.loads(path.read_text())
        choice = {(int(i), int(o)): {"decode": d, "prefill": p} for i, o, d, p in cached}
        if set(choice) == {*layer_shapes, *heads} and all(k in factories for c in choice.values() for k in c.values()):
            return choice
    except (OSError, ValueError, TypeError):
        pass
    started = time.perf_counter()
    decode_rows, prefill_rows = rows[0], min(rows[1], PREFILL_ROWS_CAP)
    choice = {}
    for shape in layer_shapes:
        decode, prefill = _fastest(shape, dtype, [decode_rows, prefill_rows], factories, default)
        choice[shape] = {"decode": decode, "prefill": prefill}
    for shape in heads:
        [decode] = _fastest(shape, dtype, [decode_rows], factories, default)
        choice[shape] = {"decode": decode, "prefill": decode}
    log.info("linear kernels timed in %.2f s: %s", time.perf_counter() - started, _describe(choice))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps([[i, o, c["decode"], c["prefill"]] for (i, o), c in choice.items()]))
        partial.replace(path)  # atomic: another worker may be reading it
    except OSError as exc:  # a read-only cache: the next start times again
        log.info("linear kernels: could not write %s (%s)", path, exc)
    return choice


def _fastest(
    shape: Shape, dtype: torch.dtype, row_counts: list[int], factories: dict[str, Factory], default: str
) -> list[str]:
    """For each row count, the kind whose call on that many rows of this shape took least (the default's within
    ``MARGIN``); each candidate made once for all the row counts."""
    in_features, out_features = shape
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype).requires_grad_(False)
    xs = [torch.randn(rows, in_features).to(dtype) for rows in row_counts]
    seconds: list[dict[str, float]] = [{} for _ in row_counts]
    with torch.inference_mode():
        for kind, factory in factories.items():
            try:
                fn = factory(linear)
                for x in xs:
                    fn(x)  # warm-up
            except Exception as exc:  # a kernel that cannot take this shape here is not a candidate for it
                log.warning("linear kernels: %s failed on %s (%s); not chosen for it", kind, shape, exc)
                continue
            for x, times in zip(xs, seconds, strict=True):
                best = float("inf")
                for _ in range(TIMED_CALLS):
                    begun = time.perf_counter()
                    fn(x)
                    best = min(best, time.perf_counter() - begun)
                times[kind] = best
    return [_pick(times, default) for times in seconds]


def _pick(seconds: dict[str, float], default: str) -> str:
    if not seconds:
        return "mkl"  # F.linear, as the layer was loaded
    fastest = min(seconds, key=seconds.__getitem__)
    if default in seconds and seconds[fastest] * (1 + MARGIN) > seconds[default]:
        return default
    return fastest


def _describe(choice: dict[Shape, Choice]) -> str:
    return ", ".join(f"{i}x{o}: {c['decode']}/{c['prefill']}" for (i, o), c in choice.items())


def split_budget_bytes() -> int:
    """``SPLIT_MEMORY_SHARE`` of the memory available now (0 where the system does not say)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return int(available * SPLIT_MEMORY_SHARE)
