"""LoRA adapters in the worker: every request of a step may name its own.

``LoraLayers`` finds every linear layer of the model's body (all but the
LM head) and gives each ``max_loras`` slots of ``A`` (``[r, in]``) and
``B`` (held as ``[r, out]``, the adapter's scale folded in), allocated once
at load so that a step allocates none. A forward hook on each layer adds,
for the rows of each adapter in the step, ``x[rows] @ A.T @ B.T`` to the
layer's output: the whole output at once (two products) when every row has
the same adapter; on the CPU at float32 and without tensor parallelism
(decodes and prefills, up to ``KERNEL_MAX_ROWS`` rows), one call of our
kernel (``cpu_kernels/lora.py``) in
which each row computes only its own adapter's product; where that kernel
is not used, for a few rows (``MASKED_MAX_ROWS``), one product over the
slots in use with each row's ``[rows, slots x r]`` middle masked to its own
slot's columns (a few operations, whatever the number of adapters); else
rows gathered per adapter and added back with ``index_add_``. A layer an adapter does not
target has rank 0 in its slot and is skipped. With tensor parallelism each
rank holds its share, cut as the layer is: a column-parallel layer's ``B``
rows of its outputs, a row-parallel layer's ``A`` columns of its inputs,
whose ``[rows, r]`` products are summed across the ranks (one all-reduce of
``rows x r`` values, after the layer's own) before ``B``.

Adapters are read (``load``) when the engine core adds them: checked
against the model (every weight names a linear layer of it, with the
layer's shapes, a rank within ``max_lora_rank``, finite values) and kept in
host memory, at most ``max_cpu_loras`` of them (the least recently used is
dropped, and read again from its directory when a step needs it). Before a
step's model call, ``prepare`` puts the step's adapters in slots (reusing a
slot that holds one already; else a free one, else the least recently used
one that this step does not need); the engine core's scheduler never puts
more than ``max_loras`` adapters in one step.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from trioserve.config import EngineConfig
from trioserve.gpu.cpu_kernels.linear import PackedLinear, PanelLinear, SplitLinear
from trioserve.gpu.cpu_kernels.lora import apply_rows, lora_kernel_available
from trioserve.gpu.tensor_shards import split_of
from trioserve.lora import WEIGHTS_FILE, AdapterConfig, AdapterError, parse_lora_module, read_adapter_config

log = logging.getLogger("trioserve.gpu.lora")

_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight")
_FILE_SLACK_BYTES = 1 << 20  # a safetensors header beyond the weights themselves
# A step of at most this many rows with several adapters runs one masked product over the slots in use (a few
# large operations, whatever the number of adapters: decodes); a larger one, a product per adapter on its rows.
MASKED_MAX_ROWS = 256
# A step of at most this many rows with any adapters runs our kernel (cpu_kernels/lora.py) where it is built: each
# row only its own adapter's product, one call per layer. It beat the per-adapter products at every row count
# measured (SmolLM2-135M's 210 layers, 4 adapters, 2 threads, AVX2: 64 against 131 ms at 256 rows, 438 against
# 624 ms at 2,048), so prefills take it too; the bound only keeps a step's row list small.
KERNEL_MAX_ROWS = 65536


@dataclass
class _Layer:
    module: torch.nn.Module
    in_features: int  # the whole layer's (with tensor parallelism, this rank holds a share)
    out_features: int
    a: torch.Tensor  # [max_loras, max_rank, in (this rank's)]
    b: torch.Tensor  # [max_loras, max_rank, out (this rank's)], scaled
    ranks: list[int]  # per slot: the rank of its adapter here, 0 where it has none
    rank_of: torch.Tensor  # the same as int64 values, for the kernel
    # With tensor parallelism: "col" (this rank computes outputs out_share of the layer), "row" (it reads inputs
    # in_share and its partial product is summed across ranks), or "" (whole).
    split: str = ""
    share: slice = field(default_factory=lambda: slice(None))

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``A`` and ``B`` for this layer."""
        if self.split == "col":
            return a, b[self.share]
        if self.split == "row":
            return a[:, self.share], b
        return a, b


@dataclass
class _Adapter:
    name: str
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None  # layer -> (A, scaled B); None: dropped for now


class LoraLayers:
    """The model's adapter slots and the adapters it knows (see the module's docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.layers: dict[str, _Layer] = {}
        for name, module in model.named_modules():
            if name.split(".")[-1] == "lm_head" or not _is_linear(module):
                continue
            n_in, n_out = int(module.in_features), int(module.out_features)
            split, share = split_of(module)
            local_in = len(range(n_in)[share]) if split == "row" else n_in
            local_out = len(range(n_out)[share]) if split == "col" else n_out
            layer = _Layer(
                module,
                n_in,
                n_out,
                torch.zeros(max_loras, max_rank, local_in, dtype=dtype, device=device),
                torch.zeros(max_loras, max_rank, local_out, dtype=dtype, device=device),
                [0] * max_loras,
                torch.zeros(max_loras, dtype=torch.int64, device=device),
                split,
                share,
            )
            self.layers[name] = layer
            module.register_forward_hook(self._hook(layer))
        self.adapters: OrderedDict[str, _Adapter] = OrderedDict()  # least recently used first
        self.pinned: set[str] = set()  # kept in memory whatever max_cpu_loras says
        self.slots: list[str | None] = [None] * max_loras
        self._slot_order: list[int] = list(range(max_loras))  # least recently used slot first
        self._segments: list[tuple[int, torch.Tensor | None]] = []  # this step's (slot, rows)
        self._mask: torch.Tensor | None = None  # [rows, slots x max_rank]: each row's own slot's columns (a few rows)
        self._slot_of: torch.Tensor | None = None  # [rows]: each row's slot (-1: none), for the kernel (a few rows)
        # Our kernel where it is built, and not with tensor parallelism (a row-parallel layer sums its middle first).
        self._kernel = not any(layer.split for layer in self.layers.values()) and lora_kernel_available(
            device, dtype, max_rank
        )

    @property
    def slot_bytes(self) -> int:
        return sum(layer.a.nbytes + layer.b.nbytes for layer in self.layers.values())

    # --- adapters ------------------------------------------------------------

    def load(self, name: str, path: str) -> int:
        """Read and check the adapter at ``path`` as ``name`` (replacing one of
        that name); its rank. ``AdapterError`` naming the file and the problem."""
        config = read_adapter_config(path, self.max_rank)
        adapter = _Adapter(name, config, self._read_weights(config))
        self.drop(name)
        self.adapters[name] = adapter
        self._keep_within_memory()
        return max(a.shape[0] for a, _ in (adapter.weights or {}).values())

    def drop(self, name: str) -> None:
        """Forget adapter ``name`` (and free its slot); nothing if unknown."""
        self.adapters.pop(name, None)
        self.pinned.discard(name)
        for slot, held in enumerate(self.slots):
            if held == name:
                self._clear_slot(slot)

    def pin(self, name: str) -> None:
        """Keep adapter ``name`` in memory whatever ``max_cpu_loras`` says."""
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")
        self.pinned.add(name)
        adapter = self.adapters[name]
        if adapter.weights is None:
            adapter.weights = self._read_weights(read_adapter_config(adapter.config.path, self.max_rank))

    def _keep_within_memory(self) -> None:
        if self.max_cpu_loras is None:
            return
        kept = [a for a in self.adapters.values() if a.weights is not None and a.name not in self.pinned]
        for adapter in kept[: max(0, len(kept) - self.max_cpu_loras)]:
            adapter.weights = None  # read again from its directory when a step needs it

    def _read_weights(self, config: AdapterConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        from safetensors import safe_open

        file = config.path / WEIGHTS_FILE
        largest = sum((layer.in_features + layer.out_features) * self.max_rank * 8 for layer in self.layers.values())
        if file.stat().st_size > largest + _FILE_SLACK_BYTES:
            raise AdapterError(f"{file}: {file.stat().st_size} bytes, more than any adapter of this model can hold")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                for key in keys:
                    found = _KEY.fullmatch(key)
                    if found is None:
                        raise AdapterError(f"{file}: {key!r} is not a LoRA layer's A or B weight")
                    module, which = found["module"], found["which"]
                    if module not in self.layers:
                        raise AdapterError(f"{file}: {key!r}: the model has no linear layer {module!r}")
                    shape = tuple(f.get_slice(key).get_shape())
                    layer = self.layers[module]
                    want = "[r, in_features]" if which == "A" else "[out_features, r]"
                    ok = len(shape) == 2 and (
                        shape[1] == layer.in_features if which == "A" else shape[0] == layer.out_features
                    )
                    rank = shape[0] if which == "A" else shape[-1]
                    if not ok:
                        raise AdapterError(
                            f"{file}: {key!r} has shape {list(shape)}, and layer {module!r} "
                            f"({layer.in_features} -> {layer.out_features}) needs {want}"
                        )
                    if not 1 <= rank <= self.max_rank:
                        raise AdapterError(
                            f"{file}: {key!r}: rank {rank} is over this server's limit of {self.max_rank} "
                            "(--max-lora-rank)"
                        )
                    pairs.setdefault(module, {})[which] = f.get_tensor(key)
        except AdapterError:
            raise
        except Exception as exc:  # safetensors' own errors: a truncated or malformed file
            raise AdapterError(f"{file}: not a readable safetensors file ({exc})") from None
        if not pairs:
            raise AdapterError(f"{file}: holds no LoRA weights")
        if isinstance(config.target_modules, tuple):
            for target in config.target_modules:
                if not any(name == target or name.endswith(f".{target}") for name in self.layers):
                    raise AdapterError(
                        f"{config.path / 'adapter_config.json'}: target_modules: the model has no linear layer "
                        f"named {target!r}"
                    )
        weights = {}
        for module, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"{file}: layer {module!r} has lora_{'A' if 'A' in pair else 'B'} without its pair")
            a, b = pair["A"], pair["B"]
            if a.shape[0] != b.shape[1]:
                raise AdapterError(f"{file}: layer {module!r}: A's rank {a.shape[0]} and B's {b.shape[1]} differ")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterError(f"{file}: layer {module!r}: weights of type {a.dtype}, not floating point")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"{file}: layer {module!r}: weights that are not finite (inf or NaN)")
            scale = config.scale_of(module, a.shape[0])
            weights[module] = (a.to(self.dtype), (b.float() * scale).to(self.dtype))
        return weights

    # --- a step --------------------------------------------------------------

    def prepare(self, rows: list[tuple[str | None, int]]) -> None:
        """Put the step's adapters in slots and note which packed rows each
        one owns. ``rows``: per request in packed order, its adapter (None:
        the base model) and its number of tokens."""
        spans: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for name, n in rows:
            if name is not None:
                spans.setdefault(name, []).append((start, start + n))
            start += n
        if len(spans) > self.max_loras:
            raise ValueError(f"a step of {len(spans)} adapters, and {self.max_loras} slots (max_loras)")
        self._segments, self._mask, self._slot_of = [], None, None
        if not spans:
            return
        slots = {name: self._slot_for(name, needed=set(spans)) for name in spans}
        if len(spans) == 1 and next(iter(spans.values())) == [(0, start)]:
            self._segments.append((slots[next(iter(spans))], None))  # every row
            return
        if self._kernel and start <= KERNEL_MAX_ROWS:  # each row its own adapter's product, in one call per layer
            slot_of = torch.full((start,), -1, dtype=torch.int64)
            for name, ranges in spans.items():
                for a, b in ranges:
                    slot_of[a:b] = slots[name]
            self._slot_of = slot_of.to(self.device)
            self._segments = [(slot, None) for slot in slots.values()]
            return
        if start <= MASKED_MAX_ROWS:  # one product over the slots in use, each row masked to its own slot's
            width = (max(slots.values()) + 1) * self.max_rank
            mask = torch.zeros(start, width, dtype=self.dtype)
            for name, ranges in spans.items():
                columns = slice(slots[name] * self.max_rank, (slots[name] + 1) * self.max_rank)
                for a, b in ranges:
                    mask[a:b, columns] = 1
            self._mask = mask.to(self.device)
            self._segments = [(slot, None) for slot in slots.values()]
            return
        for name, ranges in spans.items():
            rows_of = torch.cat([torch.arange(a, b) for a, b in ranges]).to(self.device)
            self._segments.append((slots[name], rows_of))

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise ValueError(f"a step names adapter {name!r}, which this worker has not loaded")
            free = [s for s in self._slot_order if self.slots[s] is None]
            slot = free[0] if free else next(s for s in self._slot_order if self.slots[s] not in needed)
            self._fill_slot(slot, adapter)
        self._slot_order.remove(slot)
        self._slot_order.append(slot)
        return slot

    def _fill_slot(self, slot: int, adapter: _Adapter) -> None:
        if adapter.weights is None:
            adapter.weights = self._read_weights(read_adapter_config(adapter.config.path, self.max_rank))
        self.adapters.move_to_end(adapter.name)
        self._keep_within_memory()
        self._clear_slot(slot)
        for module, whole in adapter.weights.items():
            layer, r = self.layers[module], whole[0].shape[0]
            a, b = layer.local(*whole)
            layer.a[slot, :r].copy_(a)
            layer.b[slot, :r].copy_(b.T)
            layer.ranks[slot] = r
            layer.rank_of[slot] = r
        self.slots[slot] = adapter.name

    def _clear_slot(self, slot: int) -> None:
        for layer in self.layers.values():  # zeros: the masked product reads a slot's whole max_rank columns
            layer.a[slot].zero_()
            layer.b[slot].zero_()
            layer.ranks[slot] = 0
            layer.rank_of[slot] = 0
        self.slots[slot] = None

    def _hook(self, layer: _Layer):  # type: ignore[no-untyped-def]
        def add_adapters(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not self._segments:
                return
            x = args[0].reshape(-1, layer.a.shape[-1])
            out = output.view(-1, layer.b.shape[-1])
            if (self._slot_of is not None or self._mask is not None) and not any(
                layer.ranks[slot] for slot, _ in self._segments
            ):
                return  # no adapter of this step targets this layer
            if self._slot_of is not None:
                apply_rows(x, out, layer.a, layer.b, self._slot_of, layer.rank_of)
                return
            if self._mask is not None:
                width = self._mask.shape[1]
                low = x @ layer.a.view(-1, layer.a.shape[-1])[:width].T  # [rows, width]
                low.mul_(self._mask)
                if layer.split == "row":
                    torch.distributed.all_reduce(low)
                out.addmm_(low, layer.b.view(-1, layer.b.shape[-1])[:width])
                return
            for slot, rows in self._segments:
                r = layer.ranks[slot]
                if not r:
                    continue
                a, b = layer.a[slot, :r], layer.b[slot, :r]
                low = (x if rows is None else x.index_select(0, rows)) @ a.T
                if layer.split == "row":  # each rank read its share of the inputs: their sum (after the layer's own)
                    torch.distributed.all_reduce(low)
                if rows is None:
                    out.addmm_(low, b)
                else:
                    out.index_add_(0, rows, low @ b)

        return add_adapters


def _is_linear(module: torch.nn.Module) -> bool:
    """A plain linear layer, or one the CPU kernels packed (``cpu_kernels/linear.py``)."""
    return isinstance(module, torch.nn.Linear | PanelLinear | PackedLinear | SplitLinear)


def attach_lora(
    model: torch.nn.Module,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    before: LoraLayers | None = None,
) -> LoraLayers | None:
    """The model's adapter slots when ``config.enable_lora`` (else None),
    with the adapters of ``before`` (the same model's, before its weights
    were reloaded) or else ``config.lora_modules`` loaded."""
    if not config.enable_lora:
        return None
    layers = LoraLayers(
        model,
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        device=device,
        dtype=dtype,
    )
    known = (
        [(a.name, str(a.config.path)) for a in before.adapters.values()]
        if before is not None
        else [parse_lora_module(spec) for spec in config.lora_modules]
    )
    log.info(
        "LoRA: %d layers, %d slots of rank %d: %.1f MiB",
        len(layers.layers), config.max_loras, config.max_lora_rank, layers.slot_bytes / 2**20,
    )  # fmt: skip
    for name, path in known:
        layers.load(name, path)
    return layers
