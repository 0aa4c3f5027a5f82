"""Decode attention for the CPU that reads K and V in place in the paged cache.

The portable path (``attention._decode_attention``) copies every decode's K
and V out of the cache through its block table (``index_select``) and then
runs SDPA over the copy. On the CPU the copy alone took longer than this
kernel does in all (SmolLM2-135M, 32 decodes of 64-320 tokens, one thread:
about 1.4 ms per layer to gather, 4.7-6.4 ms with SDPA, 1.1-1.5 ms here;
measured with ``scripts/bench_decode_attention.py``). torch has no paged attention for the CPU, so
this is our own: one C++ function, per sequence (threads over sequences):

1. the scores of every query head against each cached token, token by token
   (a token's K for all KV heads is one contiguous record of the cache),
   scaled, softcapped where the model says so;
2. a softmax per head over the tokens the sequence may see (all of its
   context, or the last ``window`` on sliding-window layers);
3. the weighted sum of V, token by token, into accumulators in L1.

Both passes ask for the record ``AHEAD`` tokens on before they need it: the
hardware's own prefetch stops at the end of each block of 16 tokens, and the
next block lies anywhere in the cache. On the AVX2 host, 32 decodes of 64-320
tokens in shuffled blocks, two threads, caches cold: 1.27-1.35 ms per layer
against 1.55-1.62 without (the pure read of the same K and V takes about 0.7).

Sequences whose block tables start with the same blocks (prefix-cache hits
on one system prompt) are one call with ``shared_len``, the tokens of those
blocks (``attention._shared_prefix_groups``). The kernel reads them once for
the whole group, in spans of 128 tokens across threads, with the group's
query rows as the lanes of its vectors (each K and V value broadcast against
all of them: FMAs with no horizontal sums); each sequence then reads only
the rest of its context as above, and the two parts are merged through their
max scores, as flash attention merges its tiles. Each V record of a span is
prefetched while its scores are computed (2.5x faster than without, cold).
On the prefix-caching benchmark's workload (8 decodes over a shared 1,024
tokens, bench-llama-40m, two threads) decode-only steps took 3.2 s against
3.4 s with every sequence reading its whole context (``scripts/ab_workload.py
--settings all,all-shared``). Sliding-window layers share nothing (each
sequence sees its own window).

It is built when a worker loads its model, with inductor's toolchain, and
loaded through our index (``cpp.py``): about 6 s the first time on
this machine, 0.1 s after. On by default on the CPU at float32
and at bfloat16 (``TRIOSERVE_CPU_ATTENTION=0``: the portable path); other
dtypes and devices take the portable path. The bfloat16 build converts each
K/V record to float32 as it reads it and computes in float32, rounding only
the output: 5.7x faster than the portable path's SDPA at bfloat16 on this
AVX2 host, but no longer rounded as transformers rounds, so greedy tokens
can part from transformers' at bfloat16 where logits nearly tie
(``scripts/bf16_agreement.py`` measures how often).
"""

from __future__ import annotations

import logging
import os

import torch

from trioserve.gpu.cpu_kernels import cpp

log = logging.getLogger(__name__)

# "0": decodes gather their K/V and run SDPA (the portable path) on the CPU too.
CPU_ATTENTION_ENV = "TRIOSERVE_CPU_ATTENTION"

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <vector>
using Vec = at::vec::Vectorized<float>;

static inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); }

static inline float dot(const float* a, const float* b, int64_t n) {
    const int64_t VL = Vec::size();
    Vec a0(0.f), a1(0.f);
    int64_t d = 0;
    for (; d + 2 * VL <= n; d += 2 * VL) {
        a0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), a0);
        a1 = at::vec::fmadd(Vec::loadu(a + d + VL), Vec::loadu(b + d + VL), a1);
    }
    for (; d + VL <= n; d += VL) a0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), a0);
    float x = hsum(a0 + a1);
    for (; d < n; d++) x += a[d] * b[d];
    return x;
}

// acc[0:n] += p * v[0:n]
static inline void axpy(float p, const float* v, float* acc, int64_t n) {
    const int64_t VL = Vec::size();
    const Vec vp(p);
    int64_t d = 0;
    for (; d + VL <= n; d += VL) at::vec::fmadd(vp, Vec::loadu(v + d), Vec::loadu(acc + d)).store(acc + d);
    for (; d < n; d++) acc[d] += p * v[d];
}

// Token l's record (all KV heads) asked of the memory AHEAD tokens before its use, where l < L: the hardware's
// own prefetch stops at each block's end, and the next block of a table lies anywhere in the cache. A macro:
// written as an inline function, GCC built it without the prefetches (none in the library's objdump).
constexpr int64_t AHEAD = 8;
#define PREFETCH_RECORD(cache, l)                                                                    \
    if ((l) < L) {                                                                                   \
        const scalar_t* r_ = (cache) + (table[(l) / bs] * bs + (l) % bs) * rec;                      \
        for (int64_t e = 0; e < rec; e += 64 / static_cast<int64_t>(sizeof(scalar_t))) __builtin_prefetch(r_ + e); \
    }

// A cache record as floats: itself at float32, converted into buf otherwise.
static inline const float* as_float(const float* p, float*, int64_t) { return p; }
static inline const float* as_float(const at::BFloat16* p, float* buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = static_cast<float>(p[i]);
    return buf;
}

// Attention of R query rows per KV head over the tokens [t0, t1), whose
// records lie in the blocks of table. The rows are the vectors' lanes:
// qt[(kh * D + d) * Rp + r] is dimension d of row r's (scaled) query for KV
// head kh, rows padded with zeros to Rp, a multiple of the vector size. Each K
// and V value is read once and broadcast against all rows: vector FMAs, no
// horizontal sums. Tokens are walked record by record (all heads), the order
// the hardware prefetches well, and each V record is prefetched while the
// scores are computed. Writes, per (kh, r) at i = kh * R + r, the max score
// m[i], the sum of exp(score - m[i]) l[i], and acc[i * D + d], the
// exp-weighted sum of V (not normalised).
template <typename T>
static void attend_span(const float* qt, int64_t R, int64_t Rp, const T* k_cache, const T* v_cache,
                        const int64_t* table, int64_t t0, int64_t t1, int64_t KVH, int64_t D, int64_t bs,
                        float softcap, float* m, float* l, float* acc)
{
    constexpr int64_t U = 8;  // independent accumulators per inner loop (tokens, then dimensions)
    const int64_t VL = Vec::size();
    const int64_t n = t1 - t0, rec = KVH * D;
    std::vector<const T*> k(n), v(n);
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = t0 + j, at = (table[t / bs] * bs + t % bs) * rec;
        k[j] = k_cache + at;
        v[j] = v_cache + at;
    }
    std::vector<float> s(KVH * n * Rp), acct(D * Rp), mp(Rp), lp(Rp);  // s[(kh * n + j) * Rp + r], acct[d * Rp + r]
    const int64_t line = 64 / static_cast<int64_t>(sizeof(T));
    int64_t j = 0;
    for (; j < n; j += U) {  // scores of up to U tokens, every head
        const int64_t nu = std::min(U, n - j);
        for (int64_t u = 0; u < nu; u++)
            for (int64_t e = 0; e < rec; e += line) __builtin_prefetch(v[j + u] + e);
        for (int64_t kh = 0; kh < KVH; kh++) {
            const float* qk = qt + kh * D * Rp;
            for (int64_t rv = 0; rv < Rp; rv += VL) {
                Vec a[U];
                for (int64_t u = 0; u < U; u++) a[u] = Vec(0.f);
                if (nu == U) {
                    for (int64_t d = 0; d < D; d++) {
                        const Vec qd = Vec::loadu(qk + d * Rp + rv);
                        for (int64_t u = 0; u < U; u++)
                            a[u] = at::vec::fmadd(Vec(static_cast<float>(k[j + u][kh * D + d])), qd, a[u]);
                    }
                } else {
                    for (int64_t d = 0; d < D; d++) {
                        const Vec qd = Vec::loadu(qk + d * Rp + rv);
                        for (int64_t u = 0; u < nu; u++)
                            a[u] = at::vec::fmadd(Vec(static_cast<float>(k[j + u][kh * D + d])), qd, a[u]);
                    }
                }
                for (int64_t u = 0; u < nu; u++) a[u].store(s.data() + (kh * n + j + u) * Rp + rv);
            }
        }
    }
    if (softcap > 0.f)
        for (float& x : s) x = std::tanh(x / softcap) * softcap;
    for (int64_t kh = 0; kh < KVH; kh++) {
        float* sk = s.data() + kh * n * Rp;
        for (int64_t rv = 0; rv < Rp; rv += VL) {
            Vec mx(-INFINITY), sum(0.f);
            for (int64_t jj = 0; jj < n; jj++) mx = at::vec::maximum(mx, Vec::loadu(sk + jj * Rp + rv));
            for (int64_t jj = 0; jj < n; jj++) {
                const Vec e = (Vec::loadu(sk + jj * Rp + rv) - mx).exp_u20();
                e.store(sk + jj * Rp + rv);
                sum = sum + e;
            }
            mx.store(mp.data() + rv);
            sum.store(lp.data() + rv);
            int64_t d = 0;
            for (; d + U <= D; d += U) {  // the weighted sum of V, U dimensions at a time
                Vec a[U];
                for (int64_t u = 0; u < U; u++) a[u] = Vec(0.f);
                for (int64_t jj = 0; jj < n; jj++) {
                    const Vec p = Vec::loadu(sk + jj * Rp + rv);
                    const T* vd = v[jj] + kh * D + d;
                    for (int64_t u = 0; u < U; u++) a[u] = at::vec::fmadd(Vec(static_cast<float>(vd[u])), p, a[u]);
                }
                for (int64_t u = 0; u < U; u++) a[u].store(acct.data() + (d + u) * Rp + rv);
            }
            for (; d < D; d++) {
                Vec a(0.f);
                for (int64_t jj = 0; jj < n; jj++)
                    a = at::vec::fmadd(Vec(static_cast<float>(v[jj][kh * D + d])), Vec::loadu(sk + jj * Rp + rv), a);
                a.store(acct.data() + d * Rp + rv);
            }
        }
        for (int64_t r = 0; r < R; r++) {
            m[kh * R + r] = mp[r];
            l[kh * R + r] = lp[r];
            for (int64_t dd = 0; dd < D; dd++) acc[(kh * R + r) * D + dd] = acct[dd * Rp + r];
        }
    }
}

// One query token per sequence b, packed row rows[b] of q ([T, H, D] through
// its strides) and of out ([T, H, D], contiguous); its context: ctx[b] tokens
// in the blocks tables[b, :] of the caches ([N, bs, KVH, D], contiguous).
// The first `shared` tokens (whole blocks) are the same blocks in every
// table: they are read once for the whole batch (in spans of C tokens across
// threads) and each sequence then reads only the rest of its
// context, threads over sequences; the two parts are merged through their
// max scores (as in flash attention). Sliding-window layers share nothing.
// scalar_t (the caches', q's and out's type) is float or at::BFloat16; the
// arithmetic is float either way.
extern "C" void kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int64_t* tables, const int64_t* ctx, const int64_t* rows, scalar_t* out,
                       int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t nb,
                       int64_t q_stride_t, int64_t q_stride_h,
                       int64_t window, float scale, float softcap, int64_t threads, int64_t shared)
{
    const int64_t G = H / KVH;  // query heads per KV head
    const int64_t rec = KVH * D;  // one token's K (or V), all KV heads
    const int64_t P = window > 0 ? 0 : shared;
    const int64_t R = B * G;  // query rows of one KV head: row b * G + g is head kh * G + g of sequence b
    const int64_t Rp = (R + Vec::size() - 1) / Vec::size() * Vec::size();
    const int64_t C = 128;  // tokens of the shared part per span
    const int64_t chunks = (P + C - 1) / C;
    // the shared part's partial results, at ((c * KVH + kh) * R + r): max, sum, weighted V [D]
    std::vector<float> pm(chunks * KVH * R), pl(chunks * KVH * R), pacc(chunks * KVH * R * D);
    if (P > 0) {
        std::vector<float> qt(KVH * D * Rp, 0.f);
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++)
                    qt[((h / G) * D + d) * Rp + b * G + h % G] =
                        static_cast<float>(q[rows[b] * q_stride_t + h * q_stride_h + d]) * scale;
        #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t at = c * KVH * R;
            attend_span(qt.data(), R, Rp, k_cache, v_cache, tables, c * C, std::min(P, (c + 1) * C), KVH, D, bs,
                        softcap, pm.data() + at, pl.data() + at, pacc.data() + at * D);
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = ctx[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : P;
        const int64_t n = L - start;
        const int64_t* table = tables + b * nb;
        const int64_t row = rows[b];
        std::vector<float> qs(H * D), s(H * n), mx(H, -INFINITY), sum(H, 0.f), acc(H * D, 0.f), buf(rec);
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++)
                qs[h * D + d] = static_cast<float>(q[row * q_stride_t + h * q_stride_h + d]) * scale;
        for (int64_t l = start; l < L; l++) {
            PREFETCH_RECORD(k_cache, l + AHEAD)
            const float* krec = as_float(k_cache + (table[l / bs] * bs + l % bs) * rec, buf.data(), rec);
            for (int64_t h = 0; h < H; h++) {
                float x = dot(qs.data() + h * D, krec + (h / G) * D, D);
                if (softcap > 0.f) x = std::tanh(x / softcap) * softcap;
                s[h * n + (l - start)] = x;
            }
        }
        for (int64_t h = 0; h < (n > 0 ? H : 0); h++) {  // softmax numerators against each head's max
            float* sh = s.data() + h * n;
            mx[h] = *std::max_element(sh, sh + n);
            const int64_t VL = Vec::size();
            Vec vm(mx[h]), vsum(0.f);
            int64_t i = 0;
            for (; i + VL <= n; i += VL) {
                Vec e = (Vec::loadu(sh + i) - vm).exp_u20();
                e.store(sh + i);
                vsum = vsum + e;
            }
            float total = hsum(vsum);
            for (; i < n; i++) { sh[i] = std::exp(sh[i] - mx[h]); total += sh[i]; }
            sum[h] = total;
        }
        for (int64_t l = start; l < L; l++) {
            PREFETCH_RECORD(v_cache, l + AHEAD)
            const float* vrec = as_float(v_cache + (table[l / bs] * bs + l % bs) * rec, buf.data(), rec);
            for (int64_t h = 0; h < H; h++) axpy(s[h * n + (l - start)], vrec + (h / G) * D, acc.data() + h * D, D);
        }
        for (int64_t h = 0; h < H; h++) {
            float* acc_h = acc.data() + h * D;
            const int64_t kh = h / G, r = b * G + h % G;
            float m = mx[h];
            for (int64_t c = 0; c < chunks; c++) m = std::max(m, pm[(c * KVH + kh) * R + r]);
            float total = 0.f;
            if (n > 0) {
                const float w = std::exp(mx[h] - m);
                total = sum[h] * w;
                for (int64_t d = 0; d < D; d++) acc_h[d] *= w;
            }
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t part = (c * KVH + kh) * R + r;
                const float w = std::exp(pm[part] - m);
                total += pl[part] * w;
                axpy(w, pacc.data() + part * D, acc_h, D);
            }
            const float inv = 1.f / total;
            for (int64_t d = 0; d < D; d++) out[row * H * D + h * D + d] = static_cast<scalar_t>(acc_h[d] * inv);
        }
    }
}
"""


def _source(dtype: torch.dtype) -> str:
    return f"using scalar_t = {cpp.CPP_SCALARS[dtype]};\n{_SOURCE}"


def _argtypes(dtype: torch.dtype) -> list[str]:
    scalar = cpp.CPP_SCALARS[dtype]
    return (
        [f"const {scalar}*"] * 3
        + ["const int64_t*"] * 3
        + [f"{scalar}*"]
        + ["int64_t"] * 9
        + ["float", "float", "int64_t", "int64_t"]
    )


class CpuDecodeKernel:
    """``attention.DecodeKernel`` for the CPU at float32 or bfloat16 (query,
    caches and output all of ``dtype``)."""

    def __init__(self, dtype: torch.dtype = torch.float32, simdlen: int | None = None) -> None:
        """``simdlen``: built for that vector width (``cpp.load_or_build``), not the host's widest."""
        self.dtype = dtype
        self._kernel = cpp.load_or_build("decode-attention", _source(dtype), _argtypes(dtype), simdlen)

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        token_index: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
        shared_len: int = 0,
    ) -> None:
        """Attention of the one-token sequences at rows ``token_index`` of
        query ``[1, H, T, D]`` into the same rows of ``out`` ``[T, H, D]``.
        The first ``shared_len`` tokens (whole blocks) must be in the same
        blocks in every table: they are read once for all the sequences."""
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("the decode kernel needs contiguous caches and output")
        if {query.dtype, k_cache.dtype, v_cache.dtype, out.dtype} != {self.dtype}:
            raise ValueError(f"this decode kernel is built for {self.dtype}: query, caches and output must be")
        q = query[0]  # [H, T, D]
        if shared_len and (shared_len % k_cache.shape[1] or shared_len > int(context_lens.min()) - 1):
            raise ValueError(f"shared_len {shared_len}: not whole blocks, or not short of every context")
        if q.stride(2) != 1:
            q = q.contiguous()
        heads, _, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self._kernel(
            q, k_cache, v_cache, block_tables, context_lens, token_index, out,
            block_tables.shape[0], heads, kv_heads, head_dim, block_size, block_tables.shape[1],
            q.stride(1), q.stride(0), window or 0, scale, softcap or 0.0, torch.get_num_threads(), shared_len,
        )  # fmt: skip


def load_decode_kernel(device: torch.device, dtype: torch.dtype) -> CpuDecodeKernel | None:
    """The kernel where it applies (the CPU, float32 or bfloat16, not switched
    off by ``TRIOSERVE_CPU_ATTENTION=0``) and builds; else None (the portable
    path), with the build error logged."""
    if device.type != "cpu" or dtype not in cpp.CPP_SCALARS or os.environ.get(CPU_ATTENTION_ENV, "1") == "0":
        return None
    try:
        return CpuDecodeKernel(dtype)
    except Exception as exc:  # no compiler, an unexpected toolchain: the portable path still works
        log.warning("the CPU decode attention kernel could not be built (%s); using index_select and SDPA", exc)
        return None
