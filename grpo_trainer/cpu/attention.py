"""One-token grouped-query attention in C: the decode loop's `native` attention path (rollout/decode.py).

In a decode step each row's one new query attends to its whole KV cache. SmolLM2 at 32 rows spends ~0.5 ms a layer
in SDPA's flash kernel there, ~3x the time the cache takes to read (docs/performance.md): the kernel is built for
long query blocks, and one query per head (three per key/value group) leaves most of its blocking idle. This loop
computes, per (row, key/value head), the group's scores against each cached key, a softmax and the weighted sum
of the values: each key and value is read once, for all queries of its group, and the (row, head) pairs are shared
among torch's OpenMP threads (the library links the libgomp torch has loaded, so they are the same threads).

It sums in another order than SDPA (and its exponential is a polynomial, within ~2 ulp of expf), so the decode
plan chooses it by rule, never by timing (rollout/kernels.py). Each (row, head) pair is computed by one thread
from start to end: the result does not depend on the thread count. Built once per machine and compiler
(native.py); checked against a float64 reference before it is offered.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import lru_cache

import torch

from . import native

logger = logging.getLogger(__name__)

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* e^x (Cephes' expf polynomial, x clamped to float's range): no libm call, so the loops around it vectorize. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* The cache line a few positions ahead: each (row, head)'s keys and values are a short stream (tens of KiB),
   too short for the hardware prefetcher to reach full speed on its own. */
#define AHEAD 8
#define MAX_GROUP 64
static inline void prefetch_row(const float *row, int64_t dim) {
    int64_t d;
    for (d = 0; d < dim; d += 16) __builtin_prefetch(row + d);
}

/* query [batch, kv_heads, group, dim] contiguous; key/value rows of `dim` contiguous floats, strided by batch and
   head; mask [batch, length] bytes (1: attend) or NULL; scratch: batch * kv_heads * group * length floats;
   out [batch, kv_heads, group, dim]. A row with nothing to attend gets zeros. */
void decode_attention(const float *query, const float *key, const float *value, const uint8_t *mask,
                      int64_t batch, int64_t kv_heads, int64_t group, int64_t length, int64_t dim,
                      int64_t key_batch, int64_t key_head, int64_t value_batch, int64_t value_head,
                      int64_t mask_batch, float scale, float *scratch, float *out, int threads) {
    int64_t task;
    if (group > MAX_GROUP) return; /* the callers refuse it first (attention.MAX_GROUP) */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (task = 0; task < batch * kv_heads; task++) {
        int64_t b = task / kv_heads, h = task % kv_heads, i, l, d;
        const float *q = query + task * group * dim;
        const float *k = key + b * key_batch + h * key_head, *v = value + b * value_batch + h * value_head;
        const uint8_t *attend = mask ? mask + b * mask_batch : 0;
        float *scores = scratch + task * group * length, *o = out + task * group * dim, totals[MAX_GROUP];
        for (l = 0; l < length; l++) {
            const float *kl = k + l * dim;
            if (l + AHEAD < length) prefetch_row(kl + AHEAD * dim, dim);
            for (i = 0; i < group; i++) {
                const float *qi = q + i * dim;
                float s = 0.0f;
                for (d = 0; d < dim; d++) s += qi[d] * kl[d];
                scores[i * length + l] = s * scale;
            }
        }
        for (i = 0; i < group; i++) {
            float *si = scores + i * length, top = -3.0e38f, total = 0.0f;
            for (l = 0; l < length; l++)
                if ((!attend || attend[l]) && si[l] > top) top = si[l];
            for (l = 0; l < length; l++) {
                si[l] = (!attend || attend[l]) ? exp_clamped(si[l] - top) : 0.0f;
                total += si[l];
            }
            totals[i] = total;
        }
        for (d = 0; d < group * dim; d++) o[d] = 0.0f;
        for (l = 0; l < length; l++) {  /* each value row read once for the whole group */
            const float *vl = v + l * dim;
            if (l + AHEAD < length) prefetch_row(vl + AHEAD * dim, dim);
            for (i = 0; i < group; i++) {
                float w = scores[i * length + l], *oi = o + i * dim;
                for (d = 0; d < dim; d++) oi[d] += w * vl[d];
            }
        }
        for (i = 0; i < group; i++) {
            float inverse = totals[i] > 0.0f ? 1.0f / totals[i] : 0.0f, *oi = o + i * dim;
            for (d = 0; d < dim; d++) oi[d] *= inverse;
        }
    }
}
"""

# Reassociation lets the dot products and sums vectorize; no -ffast-math: it would also assume no infinities, and
# its startup code changes the process's denormal handling where a shared library links it.
FLAGS = ["-O3", "-march=native", "-std=c99", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=off"]  # fmt: skip
MAX_GROUP = 64  # query heads per key/value head the kernel takes (its per-task softmax totals)
TOLERANCE = 2e-6  # of the output's scale, against float64: SDPA's own float32 error is of this size


@lru_cache(maxsize=1)
def attention_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here or disagrees with the float64 reference."""
    try:
        library = native.compiled("decode_attention", C_SOURCE, FLAGS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("the native decode attention is not offered here: %s", exc)
        return None
    library.decode_attention.restype = None
    library.decode_attention.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 10 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    )
    error = _error_against_float64(lambda *args: _call(library, *args))
    if error > TOLERANCE:
        logger.warning(
            "the native decode attention is off by %.2g of float64 here (limit %.0g); not offered", error, TOLERANCE
        )
        return None
    return library


def runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel runs here and takes these tensors as they are: float32 on CPU, one query per head,
    key/value rows contiguous, a boolean [B, 1, 1, L] padding mask (or none)."""
    batch, heads, queries, dim = query.shape
    length = key.shape[2]
    return (
        attention_library() is not None
        and query.device.type == "cpu"
        and queries == 1
        and all(t.dtype == torch.float32 for t in (query, key, value))
        and key.shape == value.shape
        and heads % key.shape[1] == 0
        and heads // key.shape[1] <= MAX_GROUP
        and all(t.stride(3) == 1 and t.stride(2) == dim for t in (key, value))
        and (mask is None or (mask.dtype == torch.bool and mask.shape == (batch, 1, 1, length) and mask.stride(3) == 1))
    )


def native_attention(query, key, value, mask, scaling) -> torch.Tensor:
    """query [B, H, 1, D] on key/value [B, Hkv, L, D] (a [B, 1, 1, L] boolean mask or None), as SDPA with each key/value
    head serving H / Hkv query heads; [B, H, 1, D]. Only for what `runs` accepted (the caller asks it: once a layer)."""
    return _call(attention_library(), query, key, value, mask, scaling)


def _call(library, query, key, value, mask, scaling) -> torch.Tensor:
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    folded = query.reshape(batch, kv_heads, group, dim).contiguous()
    out = torch.empty(batch, heads, 1, dim)
    scratch = torch.empty(batch * heads * length)
    attend = None if mask is None else mask.view(torch.uint8)
    library.decode_attention(
        folded.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        None if attend is None else attend.data_ptr(),
        batch,
        kv_heads,
        group,
        length,
        dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        0 if attend is None else attend.stride(0),
        dim**-0.5 if scaling is None else scaling,
        scratch.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _error_against_float64(attention) -> float:
    """The largest error of `attention` on a padded batch with strided key/value (a cache with room), relative to the
    output's largest value, against SDPA in float64."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(5, 2, 40, 16, generator=generator)
    values = torch.randn(5, 2, 40, 16, generator=generator)
    key, value = keys[:, :, :33], values[:, :, :33]  # 33 of 40 positions filled
    query = torch.randn(5, 6, 1, 16, generator=generator) * 3
    mask = torch.ones(5, 1, 1, 33, dtype=torch.bool)
    mask[1, ..., :7] = False
    mask[3, ..., :32] = False
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double().reshape(5, 2, 3, 16), key.double(), value.double(), attn_mask=mask
    ).reshape(5, 6, 1, 16)
    got = attention(query, key, value, mask, None).double()
    return float((got - expected).abs().max() / expected.abs().max())
