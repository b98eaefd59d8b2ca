"""A Llama decoder layer's small operators in C, for the decode loop's `fused` step (rollout/llama_step.py).

At 32 rows SmolLM2's decode step spends ~60 ms in its 211 linears and ~10 ms in ~1,300 small operators around them
(RMSNorm's seven, rotary's ten, SiLU and its product, the residual adds, the cache writes, views), each a few
microseconds of dispatch for a few microseconds of work, plus the Python that calls them (docs/performance.md).
Here each group between two linears is one call:

* `rms_norm`: residual add (optional) and RMSNorm, `weight * h / sqrt(mean(h^2) + eps)`;
* `swiglu`: `silu(gate) * up`;
* `rotate_store_attend`: rotary embedding of the new query and key, the key and value written into the cache's
  room, and the one-token grouped attention over the cache (attention.py's kernel, compiled into this library).

They round differently from torch's kernels (the mean of squares is summed in double, the exponentials are a
polynomial), so the decode plan chooses the fused step by rule, never by timing (rollout/decode.py). Rows are split
among torch's OpenMP threads, each row computed by one thread from start to end: the output does not depend on the
thread count. Built once per machine and compiler (native.py); checked against float64 before it is offered.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import lru_cache

import torch

from . import attention, native

logger = logging.getLogger(__name__)

C_SOURCE = (
    attention.C_SOURCE
    + r"""
/* x [rows, width]; with `residual`: h = x + residual, written back into `residual`; out = weight * h / rms(h). */
void rms_norm(const float *x, float *residual, const float *weight, float eps,
              int64_t rows, int64_t width, float *out, int threads) {
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        float *hr = residual ? residual + r * width : (float *)xr, *o = out + r * width;
        int64_t i;
        if (residual)
            for (i = 0; i < width; i++) hr[i] += xr[i];
        double squares = 0.0;
        for (i = 0; i < width; i++) squares += (double)hr[i] * hr[i];
        float inverse = (float)(1.0 / __builtin_sqrt(squares / (double)width + (double)eps));
        for (i = 0; i < width; i++) o[i] = weight[i] * (hr[i] * inverse);
    }
}

/* out = silu(gate) * up, elementwise over `rows` rows of `width` (out may be gate or up). */
void swiglu(const float *gate, const float *up, int64_t rows, int64_t width, float *out, int threads) {
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (r = 0; r < rows; r++) {
        int64_t i;
        for (i = r * width; i < (r + 1) * width; i++) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
    }
}

/* Rotary embedding of x [dim] by cos/sin [dim]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. */
static inline void rotate(const float *x, const float *c, const float *s, int64_t dim, float *out) {
    int64_t half = dim / 2, d;
    for (d = 0; d < half; d++) out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
    for (d = half; d < dim; d++) out[d] = x[d] * c[d] + x[d - half] * s[d];
}

/* One decode token per row. query [rows, heads * dim], key/value [rows, kv_heads * dim] (this token's projections),
   cos/sin [rows, dim]; the cache buffers [rows, kv_heads, room, dim] by their batch and head strides, the new
   token written at `position`, then attended with positions 0..position (mask [rows, >= position + 1] bytes, 1:
   attend, or NULL). rotated: rows * heads * dim floats; scratch: rows * heads * (position + 1) floats;
   out [rows, heads * dim]. */
void rotate_store_attend(const float *query, const float *key, const float *value, const float *cos,
                         const float *sin, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                         float *key_cache, float *value_cache, int64_t cache_batch, int64_t cache_head,
                         int64_t position, const uint8_t *mask, int64_t mask_batch, float scale,
                         float *rotated, float *scratch, float *out, int threads) {
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        int64_t h;
        for (h = 0; h < heads; h++)
            rotate(query + (r * heads + h) * dim, c, s, dim, rotated + (r * heads + h) * dim);
        for (h = 0; h < kv_heads; h++) {
            int64_t at = r * cache_batch + h * cache_head + position * dim;
            rotate(key + (r * kv_heads + h) * dim, c, s, dim, key_cache + at);
            memcpy(value_cache + at, value + (r * kv_heads + h) * dim, dim * sizeof(float));
        }
    }
    decode_attention(rotated, key_cache, value_cache, mask, rows, kv_heads, heads / kv_heads, position + 1, dim,
                     cache_batch, cache_head, cache_batch, cache_head, mask_batch, scale, scratch, out, threads);
}
"""
)
TOLERANCE = 4e-6  # of each output's scale, against float64: torch's own float32 kernels err by this much


@lru_cache(maxsize=1)
def layer_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here or disagree with the float64 reference."""
    try:
        library = native.compiled("llama_layer_ops", C_SOURCE, attention.FLAGS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("the fused decode step is not offered here: %s", exc)
        return None
    P, N, F, T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # pointer, size, float, threads
    signatures: dict[str, list[type]] = {
        "rms_norm": [P, P, P, F, N, N, P, T],
        "swiglu": [P, P, N, N, P, T],
        "rotate_store_attend": [P, P, P, P, P, N, N, N, N, P, P, N, N, N, P, N, F, P, P, P, T],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = None, argtypes
    error = _error_against_float64(library)
    if error > TOLERANCE:
        logger.warning("the fused decode step's kernels are off by %.2g of float64 here (limit %.0g); not offered",
                       error, TOLERANCE)  # fmt: skip
        return None
    return library


class LayerOps:
    """The kernels with tensors in and out (float32, contiguous, on CPU: the fused step's own buffers)."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of `x` [rows, width]; with `add`: of `x + add`, the sum written into `add` (the residual)."""
        x = x.contiguous()
        _check(x.dim() == 2 and weight.shape == x.shape[1:], "rms_norm: x [rows, width], weight [width]", x, weight)
        _check(add is None or (add.shape == x.shape and add.is_contiguous()), "rms_norm: add like x, contiguous", add)
        out = torch.empty_like(x)
        rows, width = x.shape
        self.library.rms_norm(
            x.data_ptr(), None if add is None else add.data_ptr(), weight.data_ptr(), eps, rows, width,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [rows, width], written into `gate`."""
        gate, up = gate.contiguous(), up.contiguous()
        _check(gate.dim() == 2 and up.shape == gate.shape, "swiglu: gate and up [rows, width]", gate, up)
        rows, width = gate.shape
        self.library.swiglu(gate.data_ptr(), up.data_ptr(), rows, width, gate.data_ptr(), torch.get_num_threads())
        return gate

    def rotate_store_attend(self, query, key, value, cos, sin, heads, key_cache, value_cache, position, mask, scale):
        """Rotary on `query` [rows, heads * dim] and `key` [rows, kv_heads * dim] (cos/sin [rows, dim]), the key and
        `value` written at `position` of the cache buffers [rows, kv_heads, room, dim] (unit-stride positions and
        dims, the same strides for keys and values), and attention over positions 0..position under `mask`
        ([rows, >= position + 1] uint8, or None); [rows, heads * dim]."""
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        rows, kv_heads, room, dim = key_cache.shape
        _check(
            query.shape == (rows, heads * dim) and key.shape == value.shape == (rows, kv_heads * dim)
            and cos.shape == sin.shape == (rows, dim) and cos.is_contiguous() and sin.is_contiguous()
            and heads % kv_heads == 0 and heads // kv_heads <= attention.MAX_GROUP and 0 <= position < room
            and value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride()
            and key_cache.stride(3) == 1 and key_cache.stride(2) == dim
            and (mask is None or (mask.dtype == torch.uint8 and mask.device.type == "cpu" and mask.shape[0] == rows
                                  and mask.shape[1] > position and mask.stride(1) == 1)),
            "rotate_store_attend: shapes that do not fit together",
            query, key, value, cos, sin, key_cache, value_cache,
        )  # fmt: skip
        rotated = torch.empty(rows * heads * dim)
        scratch = torch.empty(rows * heads * (position + 1))
        out = torch.empty(rows, heads * dim)
        self.library.rotate_store_attend(
            query.data_ptr(), key.data_ptr(), value.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            rows, heads, kv_heads, dim, key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0), key_cache.stride(1), position,
            None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0), scale,
            rotated.data_ptr(), scratch.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


def _check(ok: bool, what: str, *tensors: torch.Tensor | None) -> None:
    """The C kernels trust their pointers: anything else than float32 CPU tensors of fitting shapes is refused here."""
    if not ok or any(t is not None and t.dtype != torch.float32 for t in tensors):
        shapes = ", ".join("None" if t is None else f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise ValueError(f"{what}: got {shapes}")
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{what}: CPU tensors only")


def layer_ops() -> LayerOps | None:
    """The fused step's kernels where they run here, else None."""
    library = layer_library()
    return None if library is None else LayerOps(library)


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _error_against_float64(library: ctypes.CDLL) -> float:
    """The largest error of the three kernels on small random inputs (a padded batch, a cache with room), each
    relative to its output's largest value, against the same arithmetic in float64."""
    ops = LayerOps(library)
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, room, position = 5, 6, 2, 16, 40, 33
    x, add, weight = (
        torch.randn(rows, 24, generator=g) * 3,
        torch.randn(rows, 24, generator=g),
        torch.randn(24, generator=g),
    )
    residual = add.clone()
    normed = ops.rms_norm(x, weight, 1e-5, add=residual)
    h = x.double() + add.double()
    errors = [_relative(normed, weight.double() * h / (h.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()),
              _relative(residual, h)]  # fmt: skip

    gate, up = torch.randn(rows, 24, generator=g) * 6, torch.randn(rows, 24, generator=g)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    errors.append(_relative(ops.swiglu(gate.clone(), up), expected))

    query, key = torch.randn(rows, heads * dim, generator=g) * 2, torch.randn(rows, kv_heads * dim, generator=g)
    value, angles = torch.randn(rows, kv_heads * dim, generator=g), torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    key_cache, value_cache = (
        torch.randn(rows, kv_heads, room, dim, generator=g),
        torch.randn(rows, kv_heads, room, dim, generator=g),
    )
    mask = torch.ones(rows, position + 1, dtype=torch.uint8)
    mask[1, :7] = 0
    keys_before, values_before = key_cache[:, :, :position].double(), value_cache[:, :, :position].double()
    out = ops.rotate_store_attend(query, key, value, cos, sin, heads, key_cache, value_cache, position, mask, dim**-0.5)
    c, s = cos.double()[:, None], sin.double()[:, None]
    q = rotate_half_reference(query.double().view(rows, heads, dim), c, s)
    k = rotate_half_reference(key.double().view(rows, kv_heads, dim), c, s)
    keys = torch.cat([keys_before, k[:, :, None]], 2)
    values = torch.cat([values_before, value.double().view(rows, kv_heads, 1, dim)], 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.view(rows, kv_heads, heads // kv_heads, dim), keys, values, attn_mask=mask.bool()[:, None, None]
    )
    errors += [_relative(out, expected.reshape(rows, heads * dim)), _relative(key_cache[:, :, : position + 1], keys),
               _relative(value_cache[:, :, : position + 1], values)]  # fmt: skip
    return max(errors)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())
