"""Decode attention for the CPU that reads K and V in place in the paged cache.

The portable path (``attention._decode_attention``) copies every decode's K
and V out of the cache through its block table (``index_select``) and then
runs SDPA over the copy. On the CPU the copy alone took longer than this
kernel does in all (SmolLM2-135M, 32 decodes of 64-320 tokens, one thread:
about 1.4 ms per layer to gather, 4.7-6.4 ms with SDPA, 1.1-1.5 ms here;
docs/benchmarks.md, issue 13). torch has no paged attention for the CPU, so
this is our own: one C++ function, per sequence (threads over sequences):

1. the scores of every query head against each cached token, token by token
   (a token's K for all KV heads is one contiguous record of the cache),
   scaled, softcapped where the model says so;
2. a softmax per head over the tokens the sequence may see (all of its
   context, or the last ``window`` on sliding-window layers);
3. the weighted sum of V, token by token, into accumulators in L1.

It is built with inductor's own C++ toolchain and headers (``at::vec``
vectors, OpenMP) when a worker loads its model, and cached like inductor's
kernels (``compiled.inductor_cache_dir()``): about 6 s the first time on
this machine. Inductor's own lookup of a built kernel checks the compiler
and the vector ISA again in every process (about 0.8 s, in subprocesses), so
the built library's path is also kept in a small index of ours, keyed by
the source, torch, Python and the CPU's vector capability; a later worker
loads the library straight from it. On by default on the CPU at float32
and at bfloat16 (``TRIOSERVE_CPU_ATTENTION=0``: the portable path); other
dtypes and devices take the portable path. The bfloat16 build converts each
K/V record to float32 as it reads it and computes in float32, rounding only
the output: 5.7x faster than the portable path's SDPA at bfloat16 on this
AVX2 host, but no longer rounded as transformers rounds, so greedy tokens
can part from transformers' at bfloat16 where logits nearly tie
(``scripts/bf16_agreement.py`` measures how often).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from trioserve.gpu.compiled import inductor_cache_dir

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

// A cache record as floats: itself at float32, converted into buf otherwise.
static inline const float* as_float(const float* p, float*, int64_t) { return p; }
static inline const float* as_float(const at::BFloat16* p, float* buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = static_cast<float>(p[i]);
    return buf;
}

// One query token per sequence b, packed row rows[b] of q ([T, H, D] through
// its strides) and of out ([T, H, D], contiguous); its context: ctx[b] tokens
// in the blocks tables[b, :] of the caches ([N, bs, KVH, D], contiguous).
// scalar_t (the caches', q's and out's type) is float or at::BFloat16; the
// arithmetic is float either way.
extern "C" void kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int64_t* tables, const int64_t* ctx, const int64_t* rows, scalar_t* out,
                       int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t nb,
                       int64_t q_stride_t, int64_t q_stride_h,
                       int64_t window, float scale, float softcap, int64_t threads)
{
    const int64_t G = H / KVH;  // query heads per KV head
    const int64_t rec = KVH * D;  // one token's K (or V), all KV heads
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = ctx[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t n = L - start;
        const int64_t* table = tables + b * nb;
        const int64_t row = rows[b];
        std::vector<float> qs(H * D), s(H * n), inv(H), acc(H * D, 0.f), buf(rec);
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++)
                qs[h * D + d] = static_cast<float>(q[row * q_stride_t + h * q_stride_h + d]) * scale;
        for (int64_t l = start; l < L; l++) {
            const float* krec = as_float(k_cache + (table[l / bs] * bs + l % bs) * rec, buf.data(), rec);
            for (int64_t h = 0; h < H; h++) {
                float x = dot(qs.data() + h * D, krec + (h / G) * D, D);
                if (softcap > 0.f) x = std::tanh(x / softcap) * softcap;
                s[h * n + (l - start)] = x;
            }
        }
        for (int64_t h = 0; h < H; h++) {  // softmax, normalised at the end
            float* sh = s.data() + h * n;
            const float m = *std::max_element(sh, sh + n);
            const int64_t VL = Vec::size();
            Vec vm(m), vsum(0.f);
            int64_t i = 0;
            for (; i + VL <= n; i += VL) {
                Vec e = (Vec::loadu(sh + i) - vm).exp_u20();
                e.store(sh + i);
                vsum = vsum + e;
            }
            float sum = hsum(vsum);
            for (; i < n; i++) { sh[i] = std::exp(sh[i] - m); sum += sh[i]; }
            inv[h] = 1.f / sum;
        }
        for (int64_t l = start; l < L; l++) {
            const float* vrec = as_float(v_cache + (table[l / bs] * bs + l % bs) * rec, buf.data(), rec);
            for (int64_t h = 0; h < H; h++) axpy(s[h * n + (l - start)], vrec + (h / G) * D, acc.data() + h * D, D);
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++)
                out[row * H * D + h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv[h]);
    }
}
"""

# The C++ type of each dtype the kernel is built for (one library each).
_SCALARS = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}


def _source(dtype: torch.dtype) -> str:
    return f"using scalar_t = {_SCALARS[dtype]};\n{_SOURCE}"


def _argtypes(dtype: torch.dtype) -> list[str]:
    scalar = _SCALARS[dtype]
    return (
        [f"const {scalar}*"] * 3
        + ["const int64_t*"] * 3
        + [f"{scalar}*"]
        + ["int64_t"] * 9
        + ["float", "float", "int64_t"]
    )


class CpuDecodeKernel:
    """``attention.DecodeKernel`` for the CPU at float32 or bfloat16 (query,
    caches and output all of ``dtype``)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._kernel = _load_or_build(dtype)

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
    ) -> None:
        """Attention of the one-token sequences at rows ``token_index`` of
        query ``[1, H, T, D]`` into the same rows of ``out`` ``[T, H, D]``."""
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("the decode kernel needs contiguous caches and output")
        if {query.dtype, k_cache.dtype, v_cache.dtype, out.dtype} != {self.dtype}:
            raise ValueError(f"this decode kernel is built for {self.dtype}: query, caches and output must be")
        q = query[0]  # [H, T, D]
        if q.stride(2) != 1:
            q = q.contiguous()
        heads, _, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self._kernel(
            q, k_cache, v_cache, block_tables, context_lens, token_index, out,
            block_tables.shape[0], heads, kv_heads, head_dim, block_size, block_tables.shape[1],
            q.stride(1), q.stride(0), window or 0, scale, softcap or 0.0, torch.get_num_threads(),
        )  # fmt: skip


def _index_path(dtype: torch.dtype) -> Path:
    """The index entry of the kernel built for this source, dtype, torch, Python and CPU."""
    identity = "\0".join(
        [_source(dtype), repr(_argtypes(dtype)), torch.__version__, sys.version, platform.machine(),
         torch.backends.cpu.get_cpu_capability()]
    )  # fmt: skip
    return (
        inductor_cache_dir()
        / "trioserve"
        / f"decode-attention-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"
    )


def _load_or_build(dtype: torch.dtype) -> Callable[..., None]:
    """The kernel from the library our index names; else built (or found) by
    inductor, and the library it loaded written to the index."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    index = _index_path(dtype)
    try:
        entry = json.loads(index.read_text())
        if Path(entry["path"]).is_file():
            return getattr(Bindings._load_library_inner(entry["path"], entry["key"]), Bindings.entry_function)
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.info("decode attention kernel: index %s unusable (%s); building", index, exc)
    kernel = Bindings.load_pybinding(_argtypes(dtype), _source(dtype))
    for name in Bindings._loaded_module_names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, Bindings.entry_function, None) is kernel and module.__file__:
            try:
                index.parent.mkdir(parents=True, exist_ok=True)
                partial = index.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps({"path": module.__file__, "key": name.rsplit(".", 1)[0]}))
                partial.replace(index)  # atomic: another worker may be reading it
            except OSError as exc:  # a read-only cache: the next worker asks inductor again
                log.info("decode attention kernel: could not write the index %s (%s)", index, exc)
            break
    return kernel


def load_decode_kernel(device: torch.device, dtype: torch.dtype) -> CpuDecodeKernel | None:
    """The kernel where it applies (the CPU, float32 or bfloat16, not switched
    off by ``TRIOSERVE_CPU_ATTENTION=0``) and builds; else None (the portable
    path), with the build error logged."""
    if device.type != "cpu" or dtype not in _SCALARS or os.environ.get(CPU_ATTENTION_ENV, "1") == "0":
        return None
    try:
        return CpuDecodeKernel(dtype)
    except Exception as exc:  # no compiler, an unexpected toolchain: the portable path still works
        log.warning("the CPU decode attention kernel could not be built (%s); using index_select and SDPA", exc)
        return None
