"""LoRA's per-row product for the CPU: each row with its own adapter, in one call.

For a step of a few rows (decodes) spread over several adapters, the
operations of ``x @ A.T @ B.T`` per adapter cost more than their arithmetic,
and one masked product over all the slots in use computes every row against
every slot. This kernel computes exactly each row's own: for row ``m`` with
slot ``s`` (``-1``: none) of rank ``r``, ``low = A[s, :r] @ x[m]`` (``r``
dot products over the inputs), then ``y[m] += low @ B[s, :r]`` (``r``
scaled rows of ``B`` added), threads over rows. A row reads its adapter's
``A`` and ``B`` of this layer (a few tens of kilobytes), which stay in the
cache for the next row of the same adapter. Float32 only; the caller falls
back to torch's products where it cannot be built or for another dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from trioserve.gpu.cpu_kernels import cpp

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <algorithm>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t MAX_RANK = 256;

// The dot product of n floats.
static inline float dot(const float* p, const float* q, int64_t n) {
    Vec acc0(0.f), acc1(0.f);
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        acc0 = at::vec::fmadd(Vec::loadu(p + i), Vec::loadu(q + i), acc0);
        acc1 = at::vec::fmadd(Vec::loadu(p + i + W), Vec::loadu(q + i + W), acc1);
    }
    for (; i + W <= n; i += W) acc0 = at::vec::fmadd(Vec::loadu(p + i), Vec::loadu(q + i), acc0);
    float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc0 + acc1);
    for (; i < n; i++) sum += p[i] * q[i];
    return sum;
}

// x [M, K] (row stride K); y [M, N] (row stride ldy); a [S, R, K]; b [S, R, N]; slot_of [M] (-1: none);
// ranks [S] (this layer's rank of each slot's adapter, at most R <= MAX_RANK).
extern "C" void kernel(const float* x, const float* a, const float* b, float* y, const int64_t* slot_of,
                       const int64_t* ranks, int64_t M, int64_t N, int64_t K, int64_t R, int64_t ldy,
                       int64_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int64_t s = slot_of[m];
        if (s < 0) continue;
        const int64_t r = std::min(ranks[s], std::min(R, MAX_RANK));
        if (r <= 0) continue;
        float low[MAX_RANK];
        const float* xm = x + m * K;
        const float* as = a + s * R * K;
        for (int64_t k = 0; k < r; k++) low[k] = dot(as + k * K, xm, K);
        const float* bs = b + s * R * N;
        float* ym = y + m * ldy;
        int64_t n = 0;
        for (; n + W <= N; n += W) {
            Vec acc = Vec::loadu(ym + n);
            for (int64_t k = 0; k < r; k++) acc = at::vec::fmadd(Vec(low[k]), Vec::loadu(bs + k * N + n), acc);
            acc.store(ym + n);
        }
        for (; n < N; n++) {
            float acc = ym[n];
            for (int64_t k = 0; k < r; k++) acc += low[k] * bs[k * N + n];
            ym[n] = acc;
        }
    }
}
"""

MAX_RANK = 256  # the kernel's bound on a slot's rank (its per-row buffer); larger ranks take torch's products


@functools.cache
def _kernel() -> Callable[..., None] | None:
    argtypes = ["const float*"] * 3 + ["float*"] + ["const int64_t*"] * 2 + ["int64_t"] * 6
    try:
        return cpp.load_or_build("lora-float32", _SOURCE, argtypes)
    except Exception as exc:  # no compiler, say: torch's products serve
        log.info("LoRA kernel: not built (%s); adapters use torch's products", exc)
        return None


def lora_kernel_available(device: torch.device, dtype: torch.dtype, max_rank: int) -> bool:
    """Whether ``apply_rows`` serves these slots (and the kernel is built: built now if not)."""
    return device.type == "cpu" and dtype == torch.float32 and max_rank <= MAX_RANK and _kernel() is not None


def apply_rows(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_of: torch.Tensor, ranks: torch.Tensor
) -> None:
    """``out[m] += x[m] @ a[s].T @ b[s]`` for each row ``m`` with slot ``s = slot_of[m]`` (none where -1),
    using a slot's first ``ranks[s]`` ranks. ``x [M, K]`` and ``out [M, N]`` float32 rows (contiguous
    rows), ``a [S, R, K]`` and ``b [S, R, N]`` contiguous, ``slot_of [M]`` and ``ranks [S]`` int64."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the LoRA kernel is not built")
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("apply_rows: rows and slots must be contiguous")
    rows, k = x.shape
    slots, rank, n = b.shape
    if a.shape != (slots, rank, k) or out.shape != (rows, n) or slot_of.shape != (rows,) or ranks.shape != (slots,):
        raise ValueError(
            f"apply_rows: shapes x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    x = x.contiguous()
    kernel(x, a, b, out, slot_of, ranks, rows, n, k, rank, out.stride(0), torch.get_num_threads())
