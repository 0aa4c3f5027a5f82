"""int8 linear layers for the CPU: int8 weights and activations, int32 sums.

**Weights**: per output channel, symmetric: ``scale[n] = max |W[n, :]| / top``,
``Wq = round(W / scale)`` in [-top, top] (``quantize_weight``), quantized once
at load from a float checkpoint: ``top`` 127 (8 bits), or 63 (7 bits) where
the kernel is built for AVX2 (``weight_top``; below). Held in panels of 16
output columns, each column's inputs in fours (``[ceil(out / 16), ceil(in /
4), 16, 4]``): the layout of VNNI's ``vpdpbusd``, which sums four byte
products into each of sixteen int32 lanes.

**Activations**: per token, dynamic, asymmetric: each row ``x[m]`` becomes
unsigned bytes ``q = clamp(round(x / s) + z, 0, 255)`` over its own range
(``s = (max(0, max x) - min(0, min x)) / 255``, zero point ``z``), which is
what ``vpdpbusd`` multiplies (unsigned by signed bytes); ``z`` is taken back
with each column's sum of weights. Then ``y[m, n] = (sum_k (q - z) Wq[n, k])
* (s[m] * scale[n]) + b[n]``: the sum exact in int32, then one float32
product and one sum, as ``int8_reference`` computes it in plain torch (the
two agree bit for bit).

**Smoothing** (SmoothQuant): a few input channels carry most of an
activation's range, and per-row steps sized for them lose the rest. At load,
one forward pass over a conversation in the model's chat template and
``CALIBRATION_TEXT`` (``calibration_ids``, ``calibrate``) records each
input's largest value; the input is divided by ``f = act_max ** 0.5 /
w_max ** 0.5`` (in the kernel, before quantizing) and the weight's column
multiplied by it (before quantizing), which leaves the product unchanged and
evens the ranges. On SmolLM2-135M (``scripts/quality.py``): symmetric
activations without smoothing +10% perplexity, asymmetric +3.5 to +4.9%,
asymmetric and smoothed about +1 to +4% (the figure moves that much with the
last bits of the inputs: ``--perturb N``; README, "Quantization").

**Kernel**: built by inductor's toolchain (``cpp.py``) for the host. Where
the compiler targets AVX-512 VNNI (inductor's AVX-512 VNNI and AMX builds),
tiles of 12 rows x 32 columns in 24 int32 vector registers, one ``vpdpbusd``
per four inputs of a row and 16 columns (64 multiply-adds). On AVX2 (and
AVX-512 without VNNI), which has no such instruction, two paths by the
layer's weights: 7-bit ones (every ``|Wq| <= 63``: ``Int8Linear.narrow``)
take ``vpmaddubsw``, which sums two byte products into int16 without
saturating (2 x 255 x 63 < 2^15), then ``vpmaddwd`` by ones, 32 products per
two instructions, in tiles of 4 rows x 16 columns; 8-bit ones (a W8A8
checkpoint's) are widened to int16 and summed in pairs with ``vpmaddwd``
alone (255 x 127 x 2 would saturate ``vpmaddubsw``), 16 products per
instruction, what a float32 FMA does, in tiles of 3 x 16. So a float
checkpoint is quantized to 7-bit weights there: on SmolLM2-135M's 210 layer
linears (AVX2 host, 2 threads) 1.44-1.79x float32 from 8 to 512 rows against
0.87-1.05x for 8 bits, at a perplexity like 8 bits' (+0.95% and +1.18% of
float32's in one measurement, each within the spread above; 7-bit
activations instead cost +15.9%). Elsewhere the same sums in portable C++ loops. The tests build every
path on the host they run on (``cpp.load_or_build``'s ``simdlen``;
``_kernel``'s ``portable``). Threads over pairs of panels (VNNI) or panels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from trioserve.gpu.cpu_kernels import cpp
from trioserve.gpu.tensor_shards import local_tensor, split_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PANEL = 16  # output columns per panel
MAX_IN_FEATURES = 65536  # 255 * 127 * 65536 < 2**31: a row's int32 sum cannot overflow below this

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512VNNI__) && !defined(TRIOSERVE_PORTABLE)
#define TRIOSERVE_VNNI 1
#include <immintrin.h>
constexpr int MR = 12;       // rows per full tile: 12 rows x 2 panels = 24 accumulators of 16 int32
constexpr int MR_NARROW = MR;
constexpr int64_t PP = 2;    // panels per tile
#elif defined(__AVX2__) && !defined(TRIOSERVE_PORTABLE)
#define TRIOSERVE_AVX2 1
#include <immintrin.h>
constexpr int MR = 3;        // rows per full tile: 3 rows x 4 vectors = 12 accumulators of 8 int32
constexpr int MR_NARROW = 4; // with 7-bit weights: 4 rows x 2 vectors = 8 accumulators of 8 int32
constexpr int64_t PP = 1;
#else
constexpr int MR = 4;
constexpr int MR_NARROW = MR;
constexpr int64_t PP = 1;
#endif
constexpr int64_t NR = 16;   // columns per panel
constexpr int64_t MC = 240;  // rows per chunk
constexpr int64_t AHEAD = 8; // groups of four inputs prefetched ahead
using Vec = at::vec::Vectorized<float>;

// Row m of x [M, K], times inv (per input; may be null), as unsigned bytes q = clamp(round(x / s) + z, 0, 255)
// (round half to even): lo = min(0, min x), hi = max(0, max x), s = (hi - lo) / 255 (1 where that is 0),
// z = round(-lo / s); padded with z (a zero) to Kp. With ranges [M, 2] (may be null), each row's lo and hi are
// given (those of the whole row, where x holds only this rank's share of its inputs).
static void quantize_rows(const float* x, const float* inv, const float* ranges, int64_t M, int64_t K, int64_t Kp,
                          uint8_t* q, float* s, int32_t* z, int64_t threads) {
    constexpr int64_t W = Vec::size();
    #pragma omp parallel num_threads(threads)
    {
        std::vector<float> scaled(inv ? K : 0);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float* row = x + m * K;
            int64_t k = 0;
            if (inv) {
                for (; k + W <= K; k += W) (Vec::loadu(row + k) * Vec::loadu(inv + k)).store(scaled.data() + k);
                for (; k < K; k++) scaled[k] = row[k] * inv[k];
                row = scaled.data();
            }
            float lo, hi;
            if (ranges) {
                lo = ranges[2 * m];
                hi = ranges[2 * m + 1];
            } else {
                Vec vlo(0.f), vhi(0.f);
                for (k = 0; k + W <= K; k += W) {
                    const Vec v = Vec::loadu(row + k);
                    vlo = at::vec::minimum(vlo, v);
                    vhi = at::vec::maximum(vhi, v);
                }
                lo = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, vlo);
                hi = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vhi);
                for (; k < K; k++) {
                    lo = std::min(lo, row[k]);
                    hi = std::max(hi, row[k]);
                }
            }
            float scale = (hi - lo) / 255.f;
            if (!(scale > 0.f)) scale = 1.f;
            const float zero = std::nearbyint(-lo / scale);
            s[m] = scale;
            z[m] = static_cast<int32_t>(zero);
            uint8_t* out = q + m * Kp;
            const Vec vs(scale), vz(zero), v0(0.f), v255(255.f);
            float steps[W];
            for (k = 0; k + W <= K; k += W) {
                at::vec::clamp((Vec::loadu(row + k) / vs).round() + vz, v0, v255).store(steps);
                for (int64_t i = 0; i < W; i++) out[k + i] = static_cast<uint8_t>(steps[i]);
            }
            for (; k < K; k++)
                out[k] = static_cast<uint8_t>(std::clamp(std::nearbyint(row[k] / scale) + zero, 0.f, 255.f));
            for (k = K; k < Kp; k++) out[k] = static_cast<uint8_t>(z[m]);
        }
    }
}

// One row's int32 sums acc[0:nc] into y[0:nc]: (acc[c] - z wsum[c]) * (s * ws[c]) + bias[c] (bias may be null).
static inline void epilogue(const int32_t* acc, int32_t z, const int32_t* wsum, float s, const float* ws,
                            const float* bias, float* y, int64_t nc) {
    for (int64_t c = 0; c < nc; c++) {
        const float v = static_cast<float>(acc[c] - z * wsum[c]) * (s * ws[c]);
        y[c] = bias ? v + bias[c] : v;
    }
}

// For R rows of q (Kp bytes each) and Q panels side by side: y[r, c] = (sum_k q[r, k] w[k, c] - z[r] wsum[c]) *
// (s[r] * ws[c]) + bias[c] for the tile's first nc columns; bias may be null. NARROW: every weight is within
// [-63, 63] (7 bits), which AVX2 sums with vpmaddubsw (the other builds take no notice).
template <int R, int Q, bool NARROW>
static inline void tile(const uint8_t* q, int64_t Kp, const int8_t* panels, const int32_t* wsum, const float* ws,
                        const float* bias, const float* s, const int32_t* z, float* y, int64_t N, int64_t nc) {
    const int64_t K4 = Kp / 4;
#ifdef TRIOSERVE_VNNI
    __m512i a[R][Q];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < Q; j++) a[r][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K4; k++) {
        __m512i w[Q];
        for (int j = 0; j < Q; j++) {
            const int8_t* four = panels + (j * K4 + k) * NR * 4;
            w[j] = _mm512_loadu_si512(four);
            _mm_prefetch(reinterpret_cast<const char*>(four + AHEAD * NR * 4), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++) {
            int32_t bytes;
            std::memcpy(&bytes, q + r * Kp + k * 4, 4);
            const __m512i b = _mm512_set1_epi32(bytes);
            for (int j = 0; j < Q; j++) a[r][j] = _mm512_dpbusd_epi32(a[r][j], b, w[j]);
        }
    }
    for (int j = 0; j < Q; j++) {  // the epilogue in vectors of 16 columns, the last one masked
        const int64_t cols = std::min<int64_t>(NR, nc - j * NR);
        if (cols <= 0) break;
        const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
        const __m512i sj = _mm512_maskz_loadu_epi32(mask, wsum + j * NR);
        const __m512 wj = _mm512_maskz_loadu_ps(mask, ws + j * NR);
        const __m512 bj = bias ? _mm512_maskz_loadu_ps(mask, bias + j * NR) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512i exact = _mm512_sub_epi32(a[r][j], _mm512_mullo_epi32(_mm512_set1_epi32(z[r]), sj));
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(_mm512_set1_ps(s[r]), wj));
            if (bias) v = _mm512_add_ps(v, bj);
            _mm512_mask_storeu_ps(y + r * N + j * NR, mask, v);
        }
    }
#elif defined(TRIOSERVE_AVX2)
    if constexpr (NARROW) {
        // Per four inputs, a panel's 64 weight bytes are two vectors of eight columns x four; a row's four
        // bytes are broadcast; vpmaddubsw sums pairs of byte products into int16 (at most 2 x 255 x 63 < 2^15:
        // no saturation) and vpmaddwd by ones each column's two pairs into int32, the columns in order: 32
        // products per two instructions, twice vpmaddwd's alone.
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i a[R][Q * 2];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < Q * 2; j++) a[r][j] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K4; k++) {
            __m256i w[Q * 2];
            for (int j = 0; j < Q; j++) {
                const int8_t* four = panels + (j * K4 + k) * NR * 4;
                w[j * 2] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(four));
                w[j * 2 + 1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(four + 32));
                _mm_prefetch(reinterpret_cast<const char*>(four + AHEAD * NR * 4), _MM_HINT_T0);
            }
            for (int r = 0; r < R; r++) {
                int32_t bytes;
                std::memcpy(&bytes, q + r * Kp + k * 4, 4);
                const __m256i b = _mm256_set1_epi32(bytes);
                for (int j = 0; j < Q * 2; j++)
                    a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(b, w[j]), ones));
            }
        }
        for (int r = 0; r < R; r++) {
            int32_t acc[Q * NR];
            for (int j = 0; j < Q * 2; j++) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + j * 8), a[r][j]);
            epilogue(acc, z[r], wsum, s[r], ws, bias, y + r * N, nc);
        }
    } else {
        // Per four inputs, a panel's 64 weight bytes (16 columns x 4) widen to int16 in four vectors of four
        // columns; a row's four bytes widen to [x0 x1 x2 x3] x 4; vpmaddwd sums adjacent products into eight
        // int32 lanes, two per column (inputs 0-1 and 2-3), exactly (no saturation with 8-bit weights, unlike
        // vpmaddubsw). The two are added at the end.
        __m256i a[R][Q * 4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < Q * 4; j++) a[r][j] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K4; k++) {
            __m256i w[Q * 4];
            for (int j = 0; j < Q; j++) {
                const int8_t* four = panels + (j * K4 + k) * NR * 4;
                for (int v = 0; v < 4; v++)
                    w[j * 4 + v] =
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(four + v * 16)));
                _mm_prefetch(reinterpret_cast<const char*>(four + AHEAD * NR * 4), _MM_HINT_T0);
            }
            for (int r = 0; r < R; r++) {
                int32_t bytes;
                std::memcpy(&bytes, q + r * Kp + k * 4, 4);
                const __m256i b = _mm256_cvtepu8_epi16(_mm_set1_epi32(bytes));
                for (int j = 0; j < Q * 4; j++) a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(w[j], b));
            }
        }
        for (int r = 0; r < R; r++) {
            int32_t acc[Q * NR];
            for (int j = 0; j < Q * 2; j++) {  // lanes [c0 c0' c1 c1' | c2 c2' c3 c3'] and the next four columns
                const __m256i h = _mm256_hadd_epi32(a[r][2 * j], a[r][2 * j + 1]);  // [c0 c1 c4 c5 | c2 c3 c6 c7]
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + j * 8), _mm256_permute4x64_epi64(h, 0xD8));
            }
            epilogue(acc, z[r], wsum, s[r], ws, bias, y + r * N, nc);
        }
    }
#else
    int32_t acc[R][Q * NR];
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < Q * NR; c++) acc[r][c] = 0;
    for (int j = 0; j < Q; j++)
        for (int64_t k = 0; k < K4; k++) {
            const int8_t* four = panels + (j * K4 + k) * NR * 4;
            for (int r = 0; r < R; r++) {
                const uint8_t* x = q + r * Kp + k * 4;
                for (int64_t c = 0; c < NR; c++) {
                    int32_t sum = 0;
                    for (int i = 0; i < 4; i++) sum += int32_t(x[i]) * int32_t(four[c * 4 + i]);
                    acc[r][j * NR + c] += sum;
                }
            }
        }
    for (int r = 0; r < R; r++) epilogue(acc[r], z[r], wsum, s[r], ws, bias, y + r * N, nc);
#endif
}

// Rows [0, rows) of a chunk: full tiles of M rows (MR, or MR_NARROW), then one of the rest (R counts down to the
// rest's size).
template <int Q, bool NARROW, int R>
static inline void rest(int64_t rows, const uint8_t* q, int64_t Kp, const int8_t* panels, const int32_t* wsum,
                        const float* ws, const float* bias, const float* s, const int32_t* z, float* y, int64_t N,
                        int64_t nc) {
    if constexpr (R > 0) {
        if (rows == R) tile<R, Q, NARROW>(q, Kp, panels, wsum, ws, bias, s, z, y, N, nc);
        else rest<Q, NARROW, R - 1>(rows, q, Kp, panels, wsum, ws, bias, s, z, y, N, nc);
    }
}
template <int Q, bool NARROW>
static inline void rows_through(int64_t mc, const uint8_t* q, int64_t Kp, const int8_t* panels, const int32_t* wsum,
                                const float* ws, const float* bias, const float* s, const int32_t* z, float* y,
                                int64_t N, int64_t nc) {
    constexpr int M = NARROW ? MR_NARROW : MR;
    int64_t m = 0;
    for (; m + M <= mc; m += M)
        tile<M, Q, NARROW>(q + m * Kp, Kp, panels, wsum, ws, bias, s + m, z + m, y + m * N, N, nc);
    rest<Q, NARROW, M - 1>(mc - m, q + m * Kp, Kp, panels, wsum, ws, bias, s + m, z + m, y + m * N, N, nc);
}

// x [M, K] float rows -> y [M, N]. inv [K] (if has_inv): each input's multiplier before quantizing. w: int8
// panels [P, Kp / 4, NR, 4] (P = ceil(N / NR), Kp = K rounded up to 4); wsum [P * NR]: each column's sum of
// weights; ws [P * NR]: each column's scale; bias [N] (if has_bias); ranges [M, 2] (if has_ranges): each row's
// lo and hi for quantizing it (quantize_rows); narrow: every weight is within [-63, 63] (tile's NARROW).
extern "C" void kernel(const float* x, const float* inv, const int8_t* w, const int32_t* wsum, const float* ws,
                       const float* bias, const float* ranges, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t threads, int64_t has_inv, int64_t has_bias, int64_t has_ranges, int64_t narrow) {
    const int64_t Kp = (K + 3) / 4 * 4;
    const int64_t P = (N + NR - 1) / NR;
    const int64_t T = (P + PP - 1) / PP;  // tiles across
    std::vector<uint8_t> q(M * Kp);
    std::vector<float> s(M);
    std::vector<int32_t> z(M);
    quantize_rows(x, has_inv ? inv : nullptr, has_ranges ? ranges : nullptr, M, K, Kp, q.data(), s.data(), z.data(),
                  threads);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = std::min(MC, M - m0);
        const uint8_t* qc = q.data() + m0 * Kp;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const int64_t p = t * PP;
            const int8_t* panels = w + p * Kp * NR;
            const float* b = has_bias ? bias + p * NR : nullptr;
            const int64_t nc = std::min(PP * NR, N - p * NR);
            float* yp = y + m0 * N + p * NR;
            const float* sc = s.data() + m0;
            const int32_t* zc = z.data() + m0;
            const int32_t* wsp = wsum + p * NR;
            const float* wsc = ws + p * NR;
            if (P - p >= PP) {
                if (narrow) rows_through<PP, true>(mc, qc, Kp, panels, wsp, wsc, b, sc, zc, yp, N, nc);
                else rows_through<PP, false>(mc, qc, Kp, panels, wsp, wsc, b, sc, zc, yp, N, nc);
            } else {
                if (narrow) rows_through<1, true>(mc, qc, Kp, panels, wsp, wsc, b, sc, zc, yp, N, nc);
                else rows_through<1, false>(mc, qc, Kp, panels, wsp, wsc, b, sc, zc, yp, N, nc);
            }
        }
    }
}
"""

_ARGTYPES = ["const float*", "const float*", "const int8_t*", "const int32_t*", "const float*", "const float*"]
_ARGTYPES += ["const float*", "float*"] + ["int64_t"] * 8

SMOOTHING_ALPHA = 0.5  # how much of an input's range moves from the activations to the weights

# Text for the calibration pass (``calibrate``): prose, dialogue, code, numbers and lists, so that the inputs'
# ranges are those of ordinary use. Not the text scripts/quality.py measures perplexity on.
CALIBRATION_TEXT = """\
The library opens at nine in the morning and closes at six, except on Sundays, when it stays shut.
"Could you tell me where the station is?" she asked. "Two streets down, then left at the bakery."
def mean(values):
    return sum(values) / len(values) if values else 0.0
Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk; whisk until smooth.
In 1905 a patent clerk published four papers that changed physics; the year is still called his miracle year.
Q: What is 17 plus 26? A: 43. Q: Name three rivers in Africa. A: The Nile, the Congo and the Niger.
<html><body><h1>Welcome</h1><p>Prices start at $19.99 per month.</p></body></html>
The committee will meet on Thursday to review the budget, which rose by 4.5 percent over last year.
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaves of plants.
SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;
Dear team, thank you all for your hard work this quarter. Let us keep the momentum going!
"""


@functools.cache
def _kernel(simdlen: int | None = None, portable: bool = False) -> Callable[..., None]:
    """The int8 GEMM built for this host's widest vector ISA (``simdlen``: ``cpp.load_or_build``); with
    ``portable``, its portable loops whatever the ISA (for the tests)."""
    if portable:
        return cpp.load_or_build("linear-int8-portable", "#define TRIOSERVE_PORTABLE 1\n" + _SOURCE, _ARGTYPES, simdlen)
    return cpp.load_or_build("linear-int8", _SOURCE, _ARGTYPES, simdlen)


@functools.cache
def int8_build(simdlen: int | None = None) -> str:
    """Which of the kernel's paths the build for this host (or for ``simdlen``-bit vectors) compiles: "VNNI",
    "AVX2" (also AVX-512 without VNNI) or "portable"."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    with inductor_config.patch({"cpp.simdlen": simdlen}):
        isa = cpu_vec_isa.pick_vec_isa()
    if isinstance(isa, cpu_vec_isa.VecAVX512VNNI):
        return "VNNI"
    return "AVX2" if isinstance(isa, cpu_vec_isa.VecAVX2 | cpu_vec_isa.VecAVX512) else "portable"


def quantize_weight(
    weight: torch.Tensor, smooth: torch.Tensor | None = None, amax: torch.Tensor | None = None, top: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float (times ``smooth [in]``, where given) -> (int8 ``[out, in]``, float32 scale ``[out]``):
    per output channel, symmetric, in ``[-top, top]``; the scale from ``amax [out]`` where given (the largest
    of each channel's whole row, of which ``weight`` holds a share), else from ``weight``."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth[None, :]
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp(-top, top).to(torch.int8), scale


NARROW_TOP = 63  # 7-bit weights: what AVX2's vpmaddubsw sums without saturating


def weight_top(simdlen: int | None = None) -> int:
    """The largest weight step a float checkpoint is quantized to for the kernel built for this host (or
    ``simdlen``): ``NARROW_TOP`` on AVX2 (twice the multiply-adds per instruction), else 127."""
    return NARROW_TOP if int8_build(simdlen) == "AVX2" else 127


def quantize_rows(
    x: torch.Tensor, inv: torch.Tensor | None = None, ranges: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows ``[M, K]`` (times ``inv [K]``, where given) -> (their steps less the zero point, as float
    ``[M, K]``, scale ``[M]``): asymmetric per row, as the kernel quantizes them (over ``ranges [M, 2]``'s
    ``lo`` and ``hi`` where given)."""
    if inv is not None:
        x = x * inv
    lo, hi = (local_ranges(x) if ranges is None else ranges).unbind(dim=1)
    scale = (hi - lo) / 255
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    steps = (torch.round(x / scale[:, None]) + zero[:, None]).clamp(0, 255)
    return steps - zero[:, None], scale


def int8_reference(
    x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, inv: torch.Tensor | None = None,
    ranges: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """What ``Int8Linear`` computes, in plain torch: float32 rows ``[M, K]`` -> ``[M, N]``."""
    xq, xs = quantize_rows(x.float(), inv, ranges)
    sums = (xq.double() @ wq.double().T).to(torch.int32)  # exact: every term and sum is an integer below 2**53
    y = sums.float() * (xs[:, None] * scale[None, :])
    return y if bias is None else y + bias.float()


def to_panels(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[out, in]`` -> (panels ``[ceil(out / 16), ceil(in / 4), 16, 4]``, column sums
    ``[ceil(out / 16) * 16]`` int32), zero-padded."""
    out_features, in_features = wq.shape
    count, fours = -(-out_features // PANEL), -(-in_features // 4)
    padded = wq.new_zeros(count * PANEL, fours * 4)
    padded[:out_features, :in_features] = wq
    panels = padded.view(count, PANEL, fours, 4).permute(0, 2, 1, 3).contiguous()
    return panels, padded.sum(dim=1, dtype=torch.int32)


def int8_gemm(
    x: torch.Tensor,
    layer: Int8Linear,
    bias: torch.Tensor | None = None,
    simdlen: int | None = None,
    portable: bool = False,
    ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 rows ``x [M, in]`` through ``layer``'s int8 weight, with ``bias`` -> float32 ``[M, out]``
    (``simdlen``, ``portable``: the kernel built for that vector width, its portable loops: ``_kernel``;
    ``ranges [M, 2]``: each row quantized over that ``lo`` and ``hi``, not its own)."""
    args = (layer.panels, layer.wsum, layer.scale, layer.inv, bias, layer.out_features)
    return _gemm(x, *args, simdlen, portable, ranges, layer.narrow)


def _gemm(
    x: torch.Tensor, panels: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor | None,
    bias: torch.Tensor | None, out_features: int, simdlen: int | None = None, portable: bool = False,
    ranges: torch.Tensor | None = None, narrow: bool = False,
) -> torch.Tensor:  # fmt: skip
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the int8 GEMM takes float32 rows on the CPU (got {x.dtype} {tuple(x.shape)} on {x.device})")
    x = x.contiguous()
    rows, in_features = x.shape
    if panels.shape[1] != -(-in_features // 4):
        raise ValueError(f"the int8 GEMM's weight takes rows of {panels.shape[1] * 4} (got {in_features})")
    if ranges is not None and (ranges.shape != (rows, 2) or ranges.dtype != torch.float32):
        raise ValueError(f"the int8 GEMM takes float32 ranges [{rows}, 2] (got {ranges.dtype} {tuple(ranges.shape)})")
    y = x.new_empty(rows, out_features)
    if rows:
        _kernel(simdlen, portable)(
            x, y if inv is None else inv, panels, wsum, scale, y if bias is None else bias,
            y if ranges is None else ranges.contiguous(), y, rows, out_features, in_features, torch.get_num_threads(),
            int(inv is not None), int(bias is not None), int(ranges is not None), int(narrow),
        )  # fmt: skip
    return y


def local_ranges(x: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's ``(lo, hi)`` for quantizing it, ``[M, 2]``, as the kernel finds them: ``min(0, min x)`` and
    ``max(0, max x)`` of ``x`` times ``inv``."""
    scaled = x if inv is None else x * inv
    return torch.stack([scaled.amin(dim=1).clamp(max=0), scaled.amax(dim=1).clamp(min=0)], dim=1)


def row_ranges(x: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """``local_ranges`` over each whole row, where the tensor-parallel ranks each hold a share of its inputs:
    one all-reduce of ``[M, 2]``."""
    spans = local_ranges(x, inv)
    spans[:, 0].neg_()  # the lowest lo is the highest -lo
    torch.distributed.all_reduce(spans, op=torch.distributed.ReduceOp.MAX)
    spans[:, 0].neg_()
    return spans


class Int8Linear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` in int8 per output channel and ``x`` quantized per row (module docstring).

    Under tensor parallelism a column-parallel layer holds its rank's output channels and is otherwise
    unchanged; a row-parallel one (``row_parallel``) holds its rank's share of the inputs: each row is
    quantized over its whole range (``row_ranges``), the ranks' products are summed by an all-reduce, and the
    bias is added once after it. Scales and smoothing are those of the whole weight (``quantize_linears``), so
    the ranks compute the unsharded layer's int32 sums, in shares."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, scale: torch.Tensor | None = None,
        smooth: torch.Tensor | None = None, amax: torch.Tensor | None = None, row_parallel: bool = False,
        top: int | None = None,
    ) -> None:  # fmt: skip
        """``weight``: float ``[out, in]`` (quantized here, times ``smooth``, to steps in ``[-top, top]``:
        ``weight_top()`` for this host where not given), or int8 with its ``scale`` ``[out]`` (quantized from
        ``W * smooth``, where given). ``smooth [in]``: each input's share moved from the activations (divided
        by it) to the weight (multiplied). ``amax [out]``: each output channel's largest smoothed weight, where
        ``weight`` holds a share of its inputs (``quantize_weight``)."""
        super().__init__()
        self.row_parallel = row_parallel
        if weight.dtype == torch.int8:
            if scale is None:
                raise ValueError("an int8 weight needs its per-channel scale")
            wq, scale = weight, scale.float()
        else:
            wq, scale = quantize_weight(weight, smooth, amax, weight_top() if top is None else top)
        self.out_features, self.in_features = wq.shape
        if self.in_features >= MAX_IN_FEATURES:
            raise ValueError(f"int8 linear layers take fewer than {MAX_IN_FEATURES} inputs (got {self.in_features})")
        _kernel()  # built (or loaded) now, not at the first step
        self.panels, self.wsum = to_panels(wq)
        self.narrow = wq.numel() == 0 or int(wq.abs().max()) <= NARROW_TOP  # AVX2's faster sums apply
        self.scale = torch.zeros(self.wsum.shape[0], dtype=torch.float32)
        self.scale[: self.out_features] = scale
        self.inv = None if smooth is None else (1 / smooth).float().contiguous()
        self.bias = bias  # a Parameter still (float32): counted like the others
        self.tied = False  # a tied LM head is kept in float
        self.weight_bytes = self.panels.numel() + 8 * self.wsum.numel()  # int8 panels, int32 sums, float scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.row_parallel:  # this rank's share of each row's sum; the bias once, after the sum
            ranges = row_ranges(rows, self.inv)
            share = (self.panels, self.wsum, self.scale, self.inv, None, self.out_features)
            y = _gemm(rows, *share, ranges=ranges, narrow=self.narrow)
            torch.distributed.all_reduce(y)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        args = (self.panels, self.wsum, self.scale, self.inv, self.bias, self.out_features)
        if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
            y = torch.ops.trioserve.int8_linear(rows, *args, self.narrow)
        else:
            y = _gemm(rows, *args, narrow=self.narrow)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shard = ", row_parallel=True" if self.row_parallel else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{shard}"


@torch.library.custom_op("trioserve::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor, panels: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor | None,
    bias: torch.Tensor | None, out_features: int, narrow: bool,
) -> torch.Tensor:  # fmt: skip
    """``Int8Linear``'s product as an opaque op, for a compiled graph or a profile: ``[n, in]`` -> ``[n, out]``."""
    return _gemm(x, panels, wsum, scale, inv, bias, out_features, narrow=narrow)


@int8_linear.register_fake
def _int8_linear_fake(
    x: torch.Tensor, panels: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor | None,
    bias: torch.Tensor | None, out_features: int, narrow: bool,
) -> torch.Tensor:  # fmt: skip
    return x.new_empty(x.shape[0], out_features)


def smoothing(
    weight: torch.Tensor, act_max: torch.Tensor, alpha: float = SMOOTHING_ALPHA, w_max: torch.Tensor | None = None
) -> torch.Tensor:
    """SmoothQuant's per-input factors: ``act_max ** alpha / w_max ** (1 - alpha)`` (1 for an input never seen);
    ``w_max [in]``, each input's largest weight, where given (``weight`` holding a share of the outputs)."""
    if w_max is None:
        w_max = weight.detach().float().abs().amax(dim=0)
    w_max = w_max.clamp(min=1e-5)
    factors = (act_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)
    return torch.where(act_max > 0, factors, torch.ones_like(factors))


def _targets(model: torch.nn.Module, keep: tuple[str, ...]) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    return [
        (f"{parent_name}.{name}".lstrip("."), parent, name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and name not in keep
    ]


def calibrate(
    model: torch.nn.Module, ids: torch.Tensor, keep: tuple[str, ...] = ("lm_head",)
) -> dict[str, torch.Tensor]:
    """Each linear's largest absolute input per input channel (by module name) over one forward pass of ``ids``
    (``[n]`` token ids, at most the model's context), run with transformers' eager attention (the model's own
    is restored)."""
    act_max: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def seen(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            act_max[name] = torch.maximum(act_max[name], x) if name in act_max else x

        return seen

    hooks = [child.register_forward_pre_hook(hook(name)) for name, _, _, child in _targets(model, keep)]
    hf_model = cast("PreTrainedModel", model)
    attention = hf_model.config._attn_implementation
    longest = getattr(hf_model.config.get_text_config(), "max_position_embeddings", None) or len(ids)
    try:
        hf_model.set_attn_implementation("eager")  # every architecture has it (not sdpa: Gemma2)
        with torch.inference_mode():
            model(ids[None, :longest])
    finally:
        hf_model.set_attn_implementation(attention)
        for handle in hooks:
            handle.remove()
    return act_max


def quantize_linears(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *, calibration_ids: torch.Tensor | None = None,
    keep: tuple[str, ...] = ("lm_head",),
) -> int:  # fmt: skip
    """Replace every ``nn.Linear`` of ``model`` except those named in ``keep`` by an ``Int8Linear``, in place;
    returns how many. With ``calibration_ids``, each is smoothed by the inputs seen on them (``calibrate``,
    ``smoothing``). The CPU at float32 only. A model sharded by tensor parallelism is quantized shard by shard,
    with every rank (the calibration pass and the whole weights' maxima are collectives), to the scales and
    smoothing of the unsharded model."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization: int8 runs on the CPU at float32 (this worker: {device.type}, {dtype})")
    act_max = calibrate(model, calibration_ids, keep) if calibration_ids is not None else {}
    swaps = _targets(model, keep)
    for name, parent, child_name, child in swaps:
        split, _ = split_of(child)  # under tensor parallelism: this rank's outputs ("col") or inputs ("row")
        weight = local_tensor(child.weight).detach().float()
        bias = None if child.bias is None else torch.nn.Parameter(local_tensor(child.bias), requires_grad=False)
        smooth = amax = None
        if name in act_max:
            w_max = weight.abs().amax(dim=0)
            if split == "col":  # of the whole column, whose rows the ranks share
                torch.distributed.all_reduce(w_max, op=torch.distributed.ReduceOp.MAX)
            smooth = smoothing(weight, act_max[name], w_max=w_max)
        if split == "row":  # each output channel's scale over its whole row, whose inputs the ranks share
            amax = (weight if smooth is None else weight * smooth[None, :]).abs().amax(dim=1)
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        layer = Int8Linear(weight, bias, smooth=smooth, amax=amax, row_parallel=split == "row")
        setattr(parent, child_name, layer)
    return len(swaps)


CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Which city is the capital of Spain, and what is it known for?"},
    {"role": "assistant", "content": "Madrid is the capital of Spain. It is known for its museums and parks."},
]


def calibration_ids(tokenizer_dir: str) -> torch.Tensor:
    """Token ids of the model's tokenizer for ``CALIBRATION_CHAT`` in the model's chat template (where it has
    one: the special tokens a served conversation brings), then ``CALIBRATION_TEXT``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = tokenizer.apply_chat_template(CALIBRATION_CHAT, tokenize=False) if tokenizer.chat_template else ""
    return torch.tensor(tokenizer(str(chat) + CALIBRATION_TEXT)["input_ids"])
