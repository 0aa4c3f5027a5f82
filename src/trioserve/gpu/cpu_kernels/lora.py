"""LoRA's per-row product for the CPU: each row with its own adapter, in one call.

For a step of a few rows (decodes) spread over several adapters, the
operations of ``x @ A.T @ B.T`` per adapter cost more than their arithmetic,
and one masked product over all the slots in use computes every row against
every slot. This kernel computes exactly each row's own: for row ``m`` with
slot ``s`` (``-1``: none) of rank ``r``, ``low = A[s, :r] @ x[m]`` (``r``
dot products over the inputs), then ``y[m] += low @ B[s, :r]`` (``r``
scaled rows of ``B`` added). The rows are taken up to four of one adapter at
a time (threads over those groups), each row of that adapter's ``A`` and
``B`` loaded once for all four: a row alone read them once per row, and
the adapters' weights, not the arithmetic, set the kernel's time. Float32
only; the caller falls back to torch's products where it cannot be built or
for another dtype.
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
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t MAX_RANK = 256;
constexpr int ROWS = 4;  // rows of one adapter that share each load of its A and B

// low[j][k] = a[k] . x[rows[j]] for k < r; y[rows[j]] += low[j] @ b[:r]: C rows of one slot at once, each row of
// a and b loaded once for all of them.
template <int C>
static void rows_of_one_slot(const float* x, const float* as, const float* bs, float* y, const int64_t* rows,
                             int64_t r, int64_t N, int64_t K, int64_t ldy) {
    float low[C][MAX_RANK];
    const float* xr[C];
    float* yr[C];
    for (int j = 0; j < C; j++) {
        xr[j] = x + rows[j] * K;
        yr[j] = y + rows[j] * ldy;
    }
    for (int64_t k = 0; k < r; k++) {
        const float* ak = as + k * K;
        Vec acc[C];
        for (int j = 0; j < C; j++) acc[j] = Vec(0.f);
        int64_t i = 0;
        for (; i + W <= K; i += W) {
            Vec av = Vec::loadu(ak + i);
            for (int j = 0; j < C; j++) acc[j] = at::vec::fmadd(av, Vec::loadu(xr[j] + i), acc[j]);
        }
        for (int j = 0; j < C; j++) {
            float sum = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc[j]);
            for (int64_t t = i; t < K; t++) sum += ak[t] * xr[j][t];
            low[j][k] = sum;
        }
    }
    int64_t n = 0;
    for (; n + W <= N; n += W) {
        Vec acc[C];
        for (int j = 0; j < C; j++) acc[j] = Vec::loadu(yr[j] + n);
        for (int64_t k = 0; k < r; k++) {
            Vec bv = Vec::loadu(bs + k * N + n);
            for (int j = 0; j < C; j++) acc[j] = at::vec::fmadd(Vec(low[j][k]), bv, acc[j]);
        }
        for (int j = 0; j < C; j++) acc[j].store(yr[j] + n);
    }
    for (; n < N; n++) {
        for (int j = 0; j < C; j++) {
            float acc = yr[j][n];
            for (int64_t k = 0; k < r; k++) acc += low[j][k] * bs[k * N + n];
            yr[j][n] = acc;
        }
    }
}

// x [M, K] (row stride K); y [M, N] (row stride ldy); a [S, R, K]; b [S, R, N]; slot_of [M] (-1: none);
// ranks [S] (this layer's rank of each slot's adapter, at most R <= MAX_RANK).
extern "C" void kernel(const float* x, const float* a, const float* b, float* y, const int64_t* slot_of,
                       const int64_t* ranks, int64_t M, int64_t N, int64_t K, int64_t R, int64_t ldy,
                       int64_t threads) {
    // Tasks: up to ROWS rows of one slot (each slot's rows in order), so that a slot's A and B are read once
    // per task rather than once per row.
    std::vector<int64_t> order;
    std::vector<int64_t> task_start;  // each task's first entry in order
    std::vector<int64_t> task_slot;
    int64_t slots = 0;
    for (int64_t m = 0; m < M; m++) slots = std::max(slots, slot_of[m] + 1);
    order.reserve(M);
    for (int64_t s = 0; s < slots; s++) {
        const int64_t r = std::min(ranks[s], std::min(R, MAX_RANK));
        if (r <= 0) continue;
        int64_t in_task = 0;
        for (int64_t m = 0; m < M; m++) {
            if (slot_of[m] != s) continue;
            if (in_task == 0) {
                task_start.push_back(static_cast<int64_t>(order.size()));
                task_slot.push_back(s);
            }
            order.push_back(m);
            in_task = (in_task + 1) % ROWS;
        }
    }
    const int64_t tasks = static_cast<int64_t>(task_start.size());
    task_start.push_back(static_cast<int64_t>(order.size()));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t s = task_slot[t];
        const int64_t r = std::min(ranks[s], std::min(R, MAX_RANK));
        const int64_t* rows = order.data() + task_start[t];
        const int64_t count = task_start[t + 1] - task_start[t];
        const float* as = a + s * R * K;
        const float* bs = b + s * R * N;
        switch (count) {
            case 1: rows_of_one_slot<1>(x, as, bs, y, rows, r, N, K, ldy); break;
            case 2: rows_of_one_slot<2>(x, as, bs, y, rows, r, N, K, ldy); break;
            case 3: rows_of_one_slot<3>(x, as, bs, y, rows, r, N, K, ldy); break;
            default: rows_of_one_slot<4>(x, as, bs, y, rows, r, N, K, ldy); break;
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
