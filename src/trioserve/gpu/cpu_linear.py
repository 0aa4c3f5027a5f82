"""Linear layers on oneDNN's pre-packed weights, for the CPU.

``F.linear`` on the CPU calls MKL's GEMM, which re-reads the weight in its
stored layout on every call. oneDNN can reorder a weight once into the
blocked layout its kernels want (``torch.ops.mkldnn._reorder_linear_weight``)
and multiply with it directly (``torch.ops.mkldnn._linear_pointwise``): the
same product, summed in another order, so results differ from MKL's in the
last bits (greedy tokens of the tests' models are unchanged). This is what
inductor's CPU backend does for frozen linears, and what vLLM's CPU path
uses.

Measured here (docs/benchmarks.md), one thread, float32, on the decode
shapes of SmolLM2-135M (32 rows): 1.1-2.5x MKL's rate; the LM head
(576 x 49152) 18 -> 30 GFLOP/s. On large prefill rows the two are alike.

``pack_linears(model)`` swaps every ``nn.Linear`` of a model for a
``PackedLinear`` holding the packed weight. The packed copy of a tied LM
head is a second copy of the embedding matrix (the embedding lookup keeps
the original). Only for the CPU, float32 (bfloat16 where oneDNN supports it
on this CPU), and a model that is not sharded (tensor parallelism keeps its
DTensor weights).
"""

from __future__ import annotations

import os

import torch

# "0": keep F.linear everywhere; "lm_head": pack the LM head only; "all" (default): every linear.
PACKED_LINEAR_ENV = "TRIOSERVE_PACKED_LINEAR"


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` reordered once for oneDNN."""

    def __init__(self, linear: torch.nn.Linear, *, tied: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.tied = tied  # the weight is also another module's parameter (a tied LM head)
        weight = linear.weight.detach()
        self.weight_bytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # opaque blocked layout
        self.bias = linear.bias  # a Parameter still: counted and moved like the others

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; oneDNN wants a contiguous 2-D input.
        rows = x.reshape(-1, self.in_features).contiguous()
        if torch.compiler.is_compiling():  # inductor cannot lower the oneDNN op given a weight it did not pack
            y = torch.ops.trioserve.packed_linear(rows, self.packed, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("trioserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``PackedLinear``'s product as an opaque op, for a compiled graph: x ``[n, in]`` -> ``[n, out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` applies: the CPU, oneDNN built in, float32 or
    (where this CPU has native support) bfloat16, and not switched off by
    ``TRIOSERVE_PACKED_LINEAR=0``."""
    if device.type != "cpu" or os.environ.get(PACKED_LINEAR_ENV, "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: torch.nn.Module, only: str | None = None) -> int:
    """Replace every ``nn.Linear`` in ``model`` (or only the children named
    ``only``) by a ``PackedLinear``, in place; returns how many were replaced.
    By default ``only`` comes from ``TRIOSERVE_PACKED_LINEAR`` ("lm_head")."""
    if only is None and os.environ.get(PACKED_LINEAR_ENV) == "lm_head":
        only = "lm_head"
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and only in (None, name)
    ]
    # The weights other modules own (a tied LM head's is the embedding's own Parameter).
    others = {
        p.data_ptr() for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)
    }
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, tied=child.weight.data_ptr() in others))
    return len(swaps)


def packed_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Elements and bytes of the weights held packed (tied ones counted once, by their other owner)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and not m.tied]
    return sum(m.in_features * m.out_features for m in packed), sum(m.weight_bytes for m in packed)
