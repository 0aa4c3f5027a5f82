"""The element-wise work between a decoder layer's matrix multiplies, fused,
for the eager float32 runner on the CPU.

In transformers' modules an RMSNorm is eight tensor operations (square,
mean, add, rsqrt, two multiplies, two casts) and a gated MLP's activation two
(SiLU, then the product with ``up``); on a decode step's few rows each
operation costs its dispatch more than its arithmetic. ``fuse_elementwise``
gives each such module of a model one C++ call instead (built and loaded as
``cpp.py`` says):

- an RMSNorm (any module with a 1-D ``weight`` and ``variance_epsilon`` or
  ``eps`` whose output is ``weight * x / sqrt(mean(x^2) + eps)``, over the
  last dimension: the hidden states', and Qwen3's per-head query and key
  norms) computes each row's mean square and its output in one pass;
- a gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU
  ``act_fn``) computes ``silu(gate) * up`` in one pass between its linears
  (which stay modules, so LoRA's hooks on them still run).

Which modules qualify is decided by what they compute, not by their class:
at fusing, each candidate's own forward and the fused one run on the same
random input, and a module whose outputs differ (Gemma's ``1 + weight``
norm, an MLP with another activation) keeps its forward. Results differ from
torch's in the last bits (another summation order of the mean square).
The fused forwards look the module's weight and linears up at each call (a
weight loaded again is the one used) and take the module's own forward for
an input of another dtype or device. Not for ``--compile`` (inductor fuses
these itself), tensor parallelism, or another dtype;
``TRIOSERVE_FUSED_ELEMENTWISE=0`` leaves every module as it is. On
SmolLM2-135M (AVX2 host, 2 threads; ``scripts/ab_step.py --settings
all-unfused,all``): one norm of 32 rows 7-9 us against 52-69, a decode step of
32 sequences 1.06x faster at float32 and 1.07x at int8.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from trioserve.gpu.cpu_kernels import cpp

log = logging.getLogger(__name__)

FUSED_ENV = "TRIOSERVE_FUSED_ELEMENTWISE"  # "0": transformers' modules as they are

_SOURCE = r"""
#include <cmath>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t PARALLEL_FROM = 1 << 14;  // elements: below, one thread

static void rms_norm_row(const float* x, const float* w, float* out, int64_t N, float eps) {
    Vec acc(0.f);
    int64_t i = 0;
    for (; i + W <= N; i += W) {
        Vec v = Vec::loadu(x + i);
        acc = at::vec::fmadd(v, v, acc);
    }
    float sum = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc);
    for (int64_t t = i; t < N; t++) sum += x[t] * x[t];
    const float r = 1.f / std::sqrt(sum / static_cast<float>(N) + eps);
    const Vec rv(r);
    for (i = 0; i + W <= N; i += W) (Vec::loadu(w + i) * (Vec::loadu(x + i) * rv)).store(out + i);
    for (int64_t t = i; t < N; t++) out[t] = w[t] * (x[t] * r);
}

static void silu_mul_row(const float* g, const float* u, float* out, int64_t N) {
    const Vec one(1.f);
    int64_t i = 0;
    for (; i + W <= N; i += W) {
        Vec gv = Vec::loadu(g + i);
        ((gv / (one + gv.neg().exp())) * Vec::loadu(u + i)).store(out + i);
    }
    for (int64_t t = i; t < N; t++) out[t] = g[t] / (1.f + std::exp(-g[t])) * u[t];
}

// op 0: out[m] = rms_norm(a[m]) * w (a's rows of N, stride lda; w [N]; eps).
// op 1: out[m] = silu(a[m]) * b[m] (a's and b's rows of N, strides lda and ldb).
// out [M, N] contiguous.
extern "C" void kernel(const float* a, const float* b, const float* w, float* out, int64_t op, int64_t M,
                       int64_t N, int64_t lda, int64_t ldb, float eps, int64_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * N >= PARALLEL_FROM && threads > 1)
    for (int64_t m = 0; m < M; m++) {
        if (op == 0) rms_norm_row(a + m * lda, w, out + m * N, N, eps);
        else silu_mul_row(a + m * lda, b + m * ldb, out + m * N, N);
    }
}
"""

_ARGTYPES = ["const float*"] * 3 + ["float*"] + ["int64_t"] * 5 + ["float", "int64_t"]
_RMS_NORM, _SILU_MUL = 0, 1


@functools.cache
def _kernel() -> Callable[..., None] | None:
    try:
        return cpp.load_or_build("fused-elementwise", _SOURCE, _ARGTYPES)
    except Exception as exc:  # no compiler, say: the modules keep their forwards
        log.info("fused element-wise kernel: not built (%s); transformers' modules as they are", exc)
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2, -1) + eps)``, float32, in one call."""
    kernel = _kernel()
    assert kernel is not None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    kernel(x, x, weight, out, _RMS_NORM, x.numel() // n, n, n, 0, eps, torch.get_num_threads())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, float32, in one call (the two of one shape)."""
    kernel = _kernel()
    assert kernel is not None
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate = gate if gate.is_contiguous() else gate.contiguous()
    up = up if up.is_contiguous() else up.contiguous()
    out = torch.empty_like(gate)
    n = gate.shape[-1]
    kernel(gate, up, gate, out, _SILU_MUL, gate.numel() // n, n, n, n, 0.0, torch.get_num_threads())
    return out


def _is_cpu_float32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def _norm_forward(module: Any, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's weight and parts are looked up at each call (a weight loaded again stays in use)."""
    own = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if not (_is_cpu_float32(hidden_states) and _is_cpu_float32(weight)):  # not what the kernel reads
            return own(module, hidden_states)
        return rms_norm(hidden_states, weight, eps)

    return forward


def _mlp_forward(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        g, u = module.gate_proj(x), module.up_proj(x)
        if not (_is_cpu_float32(g) and _is_cpu_float32(u)) or g.shape != u.shape:
            return module.down_proj(torch.nn.functional.silu(g) * u)
        return module.down_proj(silu_mul(g, u))

    return forward


def _norm_candidate(module: torch.nn.Module) -> float | None:
    """The epsilon of a module that may be an RMSNorm (checked by ``_agrees``); else None."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    if list(module.parameters(recurse=False)) != [weight] or any(True for _ in module.children()):
        return None  # a bias, or submodules: not a plain RMSNorm
    return eps


def _mlp_candidate(module: torch.nn.Module) -> bool:
    """Whether a module may be a gated MLP (whether its activation is SiLU, ``_agrees`` tells)."""
    parts = ("gate_proj", "up_proj", "down_proj")
    return all(isinstance(getattr(module, n, None), torch.nn.Module) for n in parts) and callable(
        getattr(module, "act_fn", None)
    )


def _agrees(module: torch.nn.Module, fused: Callable[[torch.Tensor], torch.Tensor], width: int) -> bool:
    """Whether ``fused`` gives ``module``'s own output on a random input of three rows of ``width``."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)) * 2
    with torch.inference_mode():
        want, got = module(x), fused(x)
    return bool(want.shape == got.shape and torch.allclose(want, got, rtol=1e-4, atol=1e-5))


def fuse_elementwise(model: torch.nn.Module) -> tuple[int, int]:
    """Give each RMSNorm and gated SiLU MLP of ``model`` (float32, on the
    CPU) the fused forward, where it computes what the module does; the
    numbers of norms and of MLPs fused. Nothing where the kernel cannot be
    built or ``TRIOSERVE_FUSED_ELEMENTWISE=0``."""
    if os.environ.get(FUSED_ENV, "1") == "0" or _kernel() is None:
        return 0, 0
    norms = mlps = 0
    for name, module in model.named_modules():
        if "forward" in vars(module):
            continue  # already given one (fused before, or someone else's)
        eps = _norm_candidate(module)
        if eps is not None and module.weight.dtype == torch.float32:
            fused = _norm_forward(module, eps)
            if _agrees(module, fused, module.weight.shape[0]):
                module.forward = fused
                norms += 1
            else:
                log.debug("%s (%s): not an RMSNorm as fused; left as it is", name, type(module).__name__)
        elif _mlp_candidate(module):
            width = getattr(module.gate_proj, "in_features", None)
            fused = _mlp_forward(module)
            if isinstance(width, int) and _agrees(module, fused, width):
                module.forward = fused
                mlps += 1
            else:
                log.debug("%s (%s): not a gated SiLU MLP as fused; left as it is", name, type(module).__name__)
    return norms, mlps
