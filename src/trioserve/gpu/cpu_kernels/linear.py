"""Linear layers on pre-packed weights, for the CPU: our own GEMM on weights
in panels, and oneDNN's blocked weights where it has native bfloat16.

**``PanelLinear``** (float32; bfloat16 where oneDNN has no native path). The
weight is stored once as panels of 16 output columns, ``[ceil(out / 16), in,
16]`` (the last zero-padded), and multiplied by our C++ kernel (built and
loaded as ``cpp.py`` says, for the host's vector ISA): tiles of input rows x
panels held in vector registers over the whole ``in`` dimension, sized to the
ISA's registers: on AVX2 (16 registers of 8 floats) 6 rows x 1 panel, each
step one load of a panel row, six broadcasts of x and twelve FMAs; on AVX-512
(32 of 16) 12 rows x 2 panels, two loads, twelve broadcasts and 24 FMAs (on
SmolLM2-135M's linears at 2 threads on an AVX-512 host, 1.4-1.5x the AVX2
tile's rate from 8 rows on: ``scripts/bench_gemm.py``). Threads over the
tiles' columns; panels streamed in order and prefetched ahead; rows in
chunks of 256. A decode's few rows read each weight once at memory
speed, a prefill's many rows run at the FMA units' rate. Measured on an
AVX2 host (every linear of a model once in order, weights cold,
``scripts/bench_gemm.py``; docs/benchmarks.md): against oneDNN's packed
weights below, bench-llama-40m at 2 threads 1.43x at 8 rows, 1.35x at 32,
1.10x at 128, 1.01-1.03x at 512-2,048; SmolLM2-135M at one thread 1.50x at 8
rows, 1.43x at 32, 1.06x at 512 (there as fast as MKL's ``F.linear``, which
is 1.9x slower at 8 rows). Results differ from ``F.linear``'s in the last
bits (another summation order). The bfloat16 build reads bfloat16 panels and
rows, converts each panel row to float32 in registers (the rows once per
chunk), sums in float32 and rounds the output once: half the bytes of a
decode's weight reads; bench-llama-40m at 2 threads 65-95 GFLOP/s from 8
rows on, 4-5.7x ``F.linear`` at bfloat16 on that AVX2 host (which has no
native bfloat16, so oneDNN does not pack it).

**oneDNN: ``PackedLinear``** (bfloat16 where this CPU has native support;
both dtypes with ``TRIOSERVE_PACKED_LINEAR=onednn``, for comparison, or
where our kernel cannot be built). ``F.linear`` on the CPU calls MKL's GEMM,
which re-reads the weight in its stored layout on every call; oneDNN
reorders a weight once into the blocked layout its kernels want
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with it
directly (``torch.ops.mkldnn._linear_pointwise``), as inductor's CPU backend
does for frozen linears and vLLM's CPU path does: on the decode shapes of
SmolLM2-135M (32 rows, one thread, float32) 1.1-2.5x MKL's rate. On large
prefill rows the two are alike.

``pack_linears(model)`` swaps every ``nn.Linear`` of a model for one of
these, holding the weight in its layout (the original is freed); given the
decode's and a prefill's row counts (as the worker does), each layer gets
the kernel timed fastest for its shape on this host, or both for a layer
whose regimes differ (``choice.py``). The packed
copy of a tied LM head is a second copy of the embedding matrix (the
embedding lookup keeps the original). Only for the CPU and a model that is
not sharded (tensor parallelism keeps its DTensor weights). At float32 the
greedy tokens of the tests' models are the same as with ``F.linear``; at
bfloat16 how often they agree with transformers' is measured by
``scripts/bf16_agreement.py``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trioserve.gpu.cpu_kernels import cpp
from trioserve.gpu.cpu_kernels.choice import choose_kernels, split_budget_bytes
from trioserve.gpu.cpu_kernels.int8 import Int8Linear

log = logging.getLogger(__name__)

# "0": keep F.linear everywhere; "lm_head": pack the LM head only; "all" (default): every linear, each on the
# kernel timed fastest for it at start (choice.py; by the class defaults below where no row counts are given);
# "ours": every linear on our GEMM; "onednn": every linear on oneDNN's packed weights, even at float32.
PACKED_LINEAR_ENV = "TRIOSERVE_PACKED_LINEAR"

PANEL = 16  # output columns per panel of a PanelLinear's weight

_GEMM_SOURCE = r"""
#include <algorithm>
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t NR = 16;                // columns per panel
constexpr int64_t NV = NR / Vec::size();  // vectors per panel row: 2 on AVX2, 1 on AVX-512
// A full tile is MR rows x PP panels, its MR * PP * NV accumulators filling most of the ISA's vector registers
// with a few left for the panel rows and a broadcast: AVX2 (16 registers of 8 floats) 6 x 1 panel x 2 = 12;
// AVX-512 (32 of 16) 12 x 2 panels x 1 = 24.
constexpr int64_t PP = NV == 1 ? 2 : 1;   // panels per tile
constexpr int MR = NV == 1 ? 12 : 6;      // rows per full tile
constexpr int64_t MC = 256;               // rows per chunk
constexpr int64_t AHEAD = 16;             // panel rows prefetched ahead

// One panel row (NR values) as NV float vectors.
static inline void load_row(const float* p, Vec* w) {
    for (int v = 0; v < NV; v++) w[v] = Vec::loadu(p + v * Vec::size());
}
static inline void load_row(const at::BFloat16* p, Vec* w) {
    if constexpr (NV <= 2) {  // AVX2 (two vectors of 8) or AVX-512 (one of 16): one load, one conversion
        auto [lo, hi] = at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p, NR));
        w[0] = lo;
        if constexpr (NV == 2) w[1] = hi;
    } else {
        float row[NR];
        for (int64_t c = 0; c < NR; c++) row[c] = static_cast<float>(p[c]);
        for (int v = 0; v < NV; v++) w[v] = Vec::loadu(row + v * Vec::size());
    }
}

// n values of rows as floats: themselves, or converted into buf.
static inline const float* rows_as_float(const float* x, int64_t, std::vector<float>&) { return x; }
static inline const float* rows_as_float(const at::BFloat16* x, int64_t n, std::vector<float>& buf) {
    buf.resize(n);
    for (int64_t i = 0; i < n; i++) buf[i] = static_cast<float>(x[i]);
    return buf.data();
}

// y[r, c] = x[r, :] . panels[:, c] (+ bias[c]) for r < R and the tile's first nc columns (nc < Q * NR: its
// last panel is the padded one), over Q panels side by side from `panels`; summed in float and rounded to
// scalar_t once; bias (its nc values) may be null.
template <int R, int Q>
static inline void tile(const float* x, const scalar_t* panels, int64_t K, scalar_t* y, int64_t N, int64_t nc,
                        const scalar_t* bias) {
    Vec acc[R][Q][NV];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++)
            for (int v = 0; v < NV; v++) acc[r][q][v] = Vec(0.f);
    for (int64_t k = 0; k < K; k++) {
        Vec w[Q][NV];
        for (int q = 0; q < Q; q++) {
            const scalar_t* row = panels + q * K * NR + k * NR;
            load_row(row, w[q]);
            __builtin_prefetch(row + AHEAD * NR);
        }
        for (int r = 0; r < R; r++) {
            const Vec b(x[r * K + k]);
            for (int q = 0; q < Q; q++)
                for (int v = 0; v < NV; v++) acc[r][q][v] = at::vec::fmadd(b, w[q][v], acc[r][q][v]);
        }
    }
    float row[Q * NR];
    float b[Q * NR] = {};  // the bias's nc values, zero past them
    if (bias)
        for (int64_t c = 0; c < nc; c++) b[c] = static_cast<float>(bias[c]);
    for (int r = 0; r < R; r++) {
        for (int q = 0; q < Q; q++)
            for (int v = 0; v < NV; v++) acc[r][q][v].store(row + q * NR + v * Vec::size());
        for (int64_t c = 0; c < nc; c++) y[r * N + c] = static_cast<scalar_t>(row[c] + b[c]);
    }
}

// Rows [0, rows) of a chunk through tiles of Q panels: full tiles of MR rows, then one of the rest.
template <int Q, int R = MR - 1>
static inline void rest(int64_t rows, const float* x, const scalar_t* panels, int64_t K, scalar_t* y, int64_t N,
                        int64_t nc, const scalar_t* bias) {
    if constexpr (R > 0) {
        if (rows == R) tile<R, Q>(x, panels, K, y, N, nc, bias);
        else rest<Q, R - 1>(rows, x, panels, K, y, N, nc, bias);
    }
}
template <int Q>
static inline void rows_through(int64_t mc, const float* x, const scalar_t* panels, int64_t K, scalar_t* y,
                                int64_t N, int64_t nc, const scalar_t* bias) {
    int64_t m = 0;
    for (; m + MR <= mc; m += MR) tile<MR, Q>(x + m * K, panels, K, y + m * N, N, nc, bias);
    rest<Q>(mc - m, x + m * K, panels, K, y + m * N, N, nc, bias);
}

// x [M, K] and y [M, N] contiguous; w: panels [ceil(N / NR), K, NR]; bias [N] if has_bias.
// Rows of another type than float are converted once per chunk, not once per panel.
extern "C" void kernel(const scalar_t* x, const scalar_t* w, const scalar_t* bias, scalar_t* y, int64_t M, int64_t N,
                       int64_t K, int64_t threads, int64_t has_bias) {
    const int64_t P = (N + NR - 1) / NR;
    const int64_t T = (P + PP - 1) / PP;  // tiles across
    std::vector<float> converted;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = std::min(MC, M - m0);
        const float* xc = rows_as_float(x + m0 * K, mc * K, converted);
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const int64_t p = t * PP;
            const scalar_t* panels = w + p * K * NR;
            const scalar_t* b = has_bias ? bias + p * NR : nullptr;
            const int64_t nc = std::min(PP * NR, N - p * NR);
            scalar_t* yp = y + m0 * N + p * NR;
            if (P - p >= PP) rows_through<PP>(mc, xc, panels, K, yp, N, nc, b);
            else rows_through<1>(mc, xc, panels, K, yp, N, nc, b);
        }
    }
}
"""


@functools.cache
def _gemm(dtype: torch.dtype = torch.float32, simdlen: int | None = None) -> Callable[..., None]:
    """The GEMM for ``dtype``, built for the host's widest vector ISA (``simdlen``: ``cpp.load_or_build``)."""
    scalar = cpp.CPP_SCALARS[dtype]
    source = f"using scalar_t = {scalar};\n{_GEMM_SOURCE}"
    argtypes = [f"const {scalar}*"] * 3 + [f"{scalar}*"] + ["int64_t"] * 5
    return cpp.load_or_build(f"linear-{str(dtype).removeprefix('torch.')}", source, argtypes, simdlen)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> ``[ceil(out / PANEL), in, PANEL]``: column c of panel p is row p * PANEL + c."""
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    padded = weight.new_zeros(count * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(count, PANEL, in_features).transpose(1, 2).contiguous()


def panel_gemm(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, simdlen: int | None = None
) -> torch.Tensor:
    """``x [n, in]`` (the panels' dtype) times the weight held in ``panels`` -> ``[n, out]`` (``simdlen``: the
    kernel built for that vector width, ``_gemm``)."""
    if x.dim() != 2 or x.dtype != panels.dtype or x.device.type != "cpu" or panels.shape[1] != x.shape[1]:
        raise ValueError(
            f"our GEMM takes {panels.dtype} rows of {panels.shape[1]} on the CPU (got {x.dtype} {tuple(x.shape)})"
        )
    x = x.contiguous()  # the kernel reads rows back to back
    rows, in_features = x.shape
    y = x.new_empty(rows, out_features)
    if rows:
        _gemm(x.dtype, simdlen)(
            x, panels, y if bias is None else bias, y, rows, out_features, in_features, torch.get_num_threads(),
            int(bias is not None),
        )  # fmt: skip
    return y


class PanelLinear(torch.nn.Module):
    """``y = x @ W.T + b`` at float32 or bfloat16 with ``W`` held in panels for our GEMM."""

    def __init__(self, linear: torch.nn.Linear, *, tied: bool = False) -> None:
        super().__init__()
        if linear.weight.dtype not in cpp.CPP_SCALARS:
            raise ValueError(f"PanelLinear is float32 or bfloat16 only (got {linear.weight.dtype})")
        _gemm(linear.weight.dtype)  # built (or loaded) now, not at the first step; raises where it cannot be built
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.tied = tied  # the weight is also another module's parameter (a tied LM head)
        weight = linear.weight.detach()
        self.weight_bytes = weight.numel() * weight.element_size()
        self.panels = to_panels(weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # made contiguous by panel_gemm
        # Through the op: opaque to inductor, and named in a profile (gpu/profiler.py), which sees no bare call.
        if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
            y = torch.ops.trioserve.panel_linear(rows, self.panels, self.bias, self.out_features)
        else:
            y = panel_gemm(rows, self.panels, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("trioserve::panel_linear", mutates_args=())
def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``PanelLinear``'s product as an opaque op, for a compiled graph: x ``[n, in]`` -> ``[n, out]``."""
    return panel_gemm(x, panels, bias, out_features)


@panel_linear.register_fake
def _panel_linear_fake(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


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


def kernel_linear(
    x: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, out: int
) -> torch.Tensor:
    """``x [n, in]`` times a weight held for kernel ``kind`` -> ``[n, out]``."""
    if kind == "ours":
        return panel_gemm(x, weight, bias, out)
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SplitLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` held for two kernels: rows up to ``threshold`` on ``small``'s, more on
    ``large``'s (``kernel_linear``'s kinds)."""

    def __init__(self, linear: torch.nn.Linear, small: str, large: str, threshold: int, *, tied: bool = False):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.tied = tied
        self.small, self.large, self.threshold = small, large, threshold
        weight = linear.weight.detach()
        self.small_weight, self.large_weight = held_weight(weight, small), held_weight(weight, large)
        self.weight_bytes = 2 * weight.numel() * weight.element_size()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # Through the op where the row count is not known yet (a compiled graph) and where a profile must name it.
        op = _split
        if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
            op = torch.ops.trioserve.split_linear
        y = op(rows, self.small, self.small_weight, self.large, self.large_weight, self.bias, self.out_features,
               self.threshold)  # fmt: skip
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.small} up to {self.threshold} rows, else {self.large}"
        )


def held_weight(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight [out, in]`` in the layout kernel ``kind`` reads."""
    if kind == "ours":
        return to_panels(weight)
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return weight  # F.linear reads it as stored (the module it came from is dropped)


def _split(
    x: torch.Tensor, small: str, small_w: torch.Tensor, large: str, large_w: torch.Tensor,
    bias: torch.Tensor | None, out: int, threshold: int,
) -> torch.Tensor:  # fmt: skip
    if x.shape[0] <= threshold:
        return kernel_linear(x, small, small_w, bias, out)
    return kernel_linear(x, large, large_w, bias, out)


@torch.library.custom_op("trioserve::split_linear", mutates_args=())
def split_linear(
    x: torch.Tensor, small: str, small_w: torch.Tensor, large: str, large_w: torch.Tensor,
    bias: torch.Tensor | None, out_features: int, threshold: int,
) -> torch.Tensor:  # fmt: skip
    """``SplitLinear``'s product as an opaque op (the row count is known only at run time): ``[n, in]`` ->
    ``[n, out]``."""
    return _split(x, small, small_w, large, large_w, bias, out_features, threshold)


@split_linear.register_fake
def _split_linear_fake(
    x: torch.Tensor, small: str, small_w: torch.Tensor, large: str, large_w: torch.Tensor,
    bias: torch.Tensor | None, out_features: int, threshold: int,
) -> torch.Tensor:  # fmt: skip
    return x.new_empty(x.shape[0], out_features)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` applies: the CPU, float32 or bfloat16, and not
    switched off by ``TRIOSERVE_PACKED_LINEAR=0``."""
    return device.type == "cpu" and dtype in cpp.CPP_SCALARS and os.environ.get(PACKED_LINEAR_ENV, "all") != "0"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs this dtype here: float32, or bfloat16 where this CPU has native support."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_class(dtype: torch.dtype) -> type[PanelLinear] | type[PackedLinear] | None:
    """``PackedLinear`` for bfloat16 where oneDNN has native support (and for
    both dtypes with ``TRIOSERVE_PACKED_LINEAR=onednn``); else ``PanelLinear``;
    oneDNN again where our kernel cannot be built; None where neither applies."""
    onednn = onednn_packs(dtype)
    mode = os.environ.get(PACKED_LINEAR_ENV)
    if mode == "onednn" or (dtype == torch.bfloat16 and onednn and mode != "ours"):
        return PackedLinear if onednn else None
    try:
        _gemm(dtype)
        return PanelLinear
    except Exception as exc:  # no compiler, an unexpected toolchain
        log.warning("the %s GEMM kernel could not be built (%s); falling back", dtype, exc)
    return PackedLinear if onednn else None


def pack_linears(model: torch.nn.Module, only: str | None = None, rows: tuple[int, int] | None = None) -> int:
    """Replace every ``nn.Linear`` in ``model`` (or only the children named
    ``only``) in place: with ``rows`` (the decode's and a prefill's row
    counts) and ``TRIOSERVE_PACKED_LINEAR`` at its default, each by the
    kernel timed fastest for its shape (``choice.py``: one left on MKL's
    ``F.linear`` stays as it is); else by a ``PanelLinear`` (float32) or a
    ``PackedLinear`` (``_packed_class``). Returns how many were replaced. By
    default ``only`` comes from ``TRIOSERVE_PACKED_LINEAR`` ("lm_head")."""
    mode = os.environ.get(PACKED_LINEAR_ENV, "all")
    if only is None and mode == "lm_head":
        only = "lm_head"
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and only in (None, name)
    ]
    if not swaps:
        return 0
    # The weights other modules own (a tied LM head's is the embedding's own Parameter).
    others = {
        p.data_ptr() for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)
    }
    dtype = swaps[0][2].weight.dtype
    if rows is not None and mode == "all" and only is None:
        return _pack_chosen(swaps, others, dtype, rows)
    packed_class = _packed_class(dtype)
    if packed_class is None:
        return 0
    for parent, name, child in swaps:
        setattr(parent, name, packed_class(child, tied=child.weight.data_ptr() in others))
    return len(swaps)


def _pack_chosen(
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Linear]],
    others: set[int],
    dtype: torch.dtype,
    rows: tuple[int, int],
) -> int:
    """``pack_linears`` by ``choice.choose_kernels``."""
    factories: dict[str, Callable[[torch.nn.Linear], Callable[[torch.Tensor], torch.Tensor]]] = {}
    try:
        _gemm(dtype)
        factories["ours"] = PanelLinear
    except Exception as exc:  # no compiler, an unexpected toolchain
        log.warning("the %s GEMM kernel could not be built (%s); choosing among the others", dtype, exc)
    if onednn_packs(dtype):
        factories["onednn"] = PackedLinear
    factories["mkl"] = lambda linear: linear
    default = {PanelLinear: "ours", PackedLinear: "onednn", None: "mkl"}[_packed_class(dtype)]

    def shape(linear: torch.nn.Linear) -> tuple[int, int]:
        return (linear.in_features, linear.out_features)

    heads = [shape(child) for _, name, child in swaps if name == "lm_head"]
    layers = [shape(child) for _, name, child in swaps if name != "lm_head"]
    choice = choose_kernels(layers, heads, dtype, rows, factories, default)
    budget = split_budget_bytes()
    replaced = 0
    for parent, name, child in swaps:
        picked = choice[shape(child)]
        tied = child.weight.data_ptr() in others
        size = child.weight.numel() * child.weight.element_size()
        if name != "lm_head" and picked["decode"] != picked["prefill"] and size <= budget:
            budget -= size
            module: torch.nn.Module = SplitLinear(child, picked["decode"], picked["prefill"], rows[0], tied=tied)
        elif picked["decode"] == "mkl":
            continue
        else:
            module = PanelLinear(child, tied=tied) if picked["decode"] == "ours" else PackedLinear(child, tied=tied)
        setattr(parent, name, module)
        replaced += 1
    return replaced


def packed_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Elements and bytes of the weights held packed or in int8 (tied ones counted once, by their other owner)."""
    kinds = PanelLinear | PackedLinear | SplitLinear | Int8Linear
    packed = [m for m in model.modules() if isinstance(m, kinds) and not m.tied]
    return sum(m.in_features * m.out_features for m in packed), sum(m.weight_bytes for m in packed)
