"""The sampler's multinomial draw, three exact ways: the tokens `torch.multinomial(probs, 1)` gives for a seed.

`torch.multinomial(p, 1)` on a CPU tensor draws one Exp(1) variate per vocabulary entry from the default
generator (a Mersenne Twister, mt19937) and returns argmax(p / q). The variates are made one at a time:
two 32-bit outputs give 53 random bits u in [0, 1), and q = -log1p(-u) in double, rounded to float32
(ATen's `exponential_` on CPU; its MKL path is compiled out of the public wheels). For SmolLM2's 49,152
tokens and 16 rows that is 786k logarithms per decode step, a large share of the step (docs/performance.md).

All three alternatives below give the same token as `torch.multinomial` and leave the generator in the
same state, so sampling stays reproducible per seed and equal to `generate`'s (tests/test_decode_kernels.py checks
every alternative against torch, draw for draw):

* `torch`: `probs / empty_like(probs).exponential_()` then argmax, as multinomial computes it (minus its
  argument checks).
* `numpy`: the same Mersenne Twister from numpy (`np.random.MT19937`, same algorithm, fed the torch
  generator's state), 53-bit uniforms and logarithms as whole-array operations, then the exact float32
  ratio recomputed for the few entries within rounding distance of each row's maximum (so a logarithm that
  differs from ATen's in the last bit cannot change the token).
* `native`: one C loop (compiled once per machine with the system C compiler, for its CPU, cached beside
  the models) that walks the same stream and computes the logarithm only for entries that can still win:
  q >= u, so entry j cannot beat the current best ratio b when p_j <= b * u_j (with a margin larger than
  all roundings). Most of a vocabulary's probabilities are tiny, so almost every entry costs two twister
  outputs and a comparison, screened a block of the twister's state at a time.

Which one runs is measured per machine and recorded in the run's decode kernel plan (rollout/kernels.py); CUDA
tensors always take `torch` (the others emulate the CPU generator only), and so does every draw where torch's
generator is not as the emulations expect (torch_internals.check_generator_state; paths.py warns once).
"""

from __future__ import annotations

import ctypes
import logging
import math
import subprocess
from functools import lru_cache

import numpy as np
import torch

from . import native, paths
from .torch_internals import set_twister_state, twister_state

logger = logging.getLogger(__name__)


def draw_torch(probs: torch.Tensor) -> torch.Tensor:
    """What torch.multinomial(probs, 1) does for rows of probabilities [B, V], minus its argument checks."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def _emulable(probs: torch.Tensor) -> bool:
    return probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and paths.usable("draw")


# ----------------------------------------------------------------------------- numpy


def draw_numpy(probs: torch.Tensor) -> torch.Tensor:
    """The torch draw, with numpy's Mersenne Twister and whole-array logarithms; the winner re-checked exactly."""
    if not _emulable(probs):
        return draw_torch(probs)
    p = probs.contiguous().numpy()
    key, pos, raw = twister_state()
    twister = np.random.MT19937()
    twister.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    words = twister.random_raw(2 * p.size).reshape(p.shape[0], p.shape[1], 2)  # [B, V, (high, low)]
    state = twister.state["state"]
    set_twister_state(state["key"], int(state["pos"]), raw)
    # The low 53 bits of (high << 32 | low), times 2^-53: exact in float64 written as two terms.
    u = (words[..., 0] & 0x1FFFFF).astype(np.float64) * 2.0**-21 + words[..., 1].astype(np.float64) * 2.0**-53
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = p / (-np.log1p(-u)).astype(np.float32)  # [B, V] float32, as ATen divides
        tokens = []
        for row in range(p.shape[0]):
            r = ratio[row]
            if np.isnan(r).any():  # only where u == 0 and p == 0; torch's argmax takes the first NaN
                tokens.append(
                    _exact_argmax(p[row], u[row], np.flatnonzero(np.isnan(r) | (r >= np.nanmax(r) * (1 - 1e-5))))
                )
                continue
            top = r.max()
            candidates = np.flatnonzero(r >= top * (1 - 1e-5)) if np.isfinite(top) else np.flatnonzero(r == top)
            tokens.append(int(candidates[0]) if len(candidates) == 1 else _exact_argmax(p[row], u[row], candidates))
    return torch.tensor(tokens, dtype=torch.long)


def _exact_argmax(p: np.ndarray, u: np.ndarray, candidates: np.ndarray) -> int:
    """Among `candidates` (ascending), the one torch's argmax picks, each ratio computed as ATen computes it
    (libm's log1p in double, rounded to float32, float32 division): first NaN, else first maximum."""
    best, best_index = None, -1
    for j in candidates.tolist():
        q = np.float32(-math.log1p(-float(u[j])))
        with np.errstate(divide="ignore", invalid="ignore"):
            value = np.float32(p[j]) / q
        if best is None or (np.isnan(value) and not np.isnan(best)) or (not np.isnan(best) and value > best):
            best, best_index = value, j
    return best_index


# ----------------------------------------------------------------------------- native (C)

C_SOURCE = r"""
/* The token torch.multinomial(p, 1) draws on CPU, for rows of float32 probabilities, from a mt19937 state
   (key[624], pos: index of the next word, 624 = twist first). Same stream, same rounding as ATen:
   u = low 53 bits of (first << 32 | second) * 2^-53, q = (float)(-log1p(-u)), ratio = p / q in float32,
   argmax with the first NaN, else the first maximum, winning.

   log1p is computed only where entry j can still win: q >= u, so p_j <= best * u_j * (1 - 1e-6) means
   ratio_j <= best after every rounding. The twister's words are tempered a block at a time, and each block's
   entries are screened in a first pass against the bound at the block's start (the bound only grows, so
   the screen keeps every entry the exact second pass could take). */
#include <stdint.h>
#include <math.h>

#define N 624
#define M 397

static void twist(uint32_t *s) {
    int i;
    uint32_t y;
#define MIX(a, b, c) (y = ((a) & 0x80000000u) | ((b) & 0x7fffffffu), (c) ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u))
    for (i = 0; i < N - M; i++) s[i] = MIX(s[i], s[i + 1], s[i + M]);
    for (; i < N - 1; i++) s[i] = MIX(s[i], s[i + 1], s[i + M - N]);
    s[N - 1] = MIX(s[N - 1], s[0], s[M - 1]);
#undef MIX
}

static inline uint32_t temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

typedef struct { uint32_t *key; int64_t pos; } stream;

static inline uint32_t next_word(stream *s) {
    if (s->pos >= N) { twist(s->key); s->pos = 0; }
    return temper(s->key[s->pos++]);
}

static inline double uniform(uint64_t high, uint64_t low) {
    return (double)(((high << 32) | low) & ((1ULL << 53) - 1)) * 0x1p-53;
}

typedef struct { float best; double bound; int64_t index; } running_max;

/* The exact step for entry j: ATen's q and ratio, and torch.argmax's order (first NaN, else first maximum). */
static inline void consider(running_max *m, float p, double u, int64_t j) {
    float q, ratio;
    if (m->index >= 0 && u > 0.0 && (double)p <= m->bound * u) return;
    q = (float)(-log1p(-u));
    ratio = p / q;
    if (m->index < 0 || (isnan(ratio) && !isnan(m->best)) || (!isnan(m->best) && ratio > m->best)) {
        m->best = ratio;
        m->bound = (double)ratio * (1.0 - 1e-6);
        m->index = j;
    }
}

void exponential_argmax(uint32_t *key, int64_t *pos, const float *probs, int64_t rows, int64_t vocab, int64_t *out) {
    stream s = {key, *pos};
    uint32_t words[N];
    unsigned char keep[N / 2];
    int64_t r, j, k, n;
    for (r = 0; r < rows; r++) {
        const float *p = probs + r * vocab;
        running_max m = {0.0f, 0.0, -1};
        j = 0;
        while (j < vocab) {
            if (s.pos > N - 2 || m.index < 0) {  /* across a block boundary, or the first entry: one at a time */
                uint64_t high = next_word(&s), low = next_word(&s);
                consider(&m, p[j], uniform(high, low), j);
                j++;
                continue;
            }
            n = (N - s.pos) / 2;  /* whole entries left in this block */
            if (n > vocab - j) n = vocab - j;
            for (k = 0; k < 2 * n; k++) words[k] = temper(key[s.pos + k]);
            for (k = 0; k < n; k++)  /* the screen: vectorizable, against the bound at the block's start */
                keep[k] = !(uniform(words[2 * k], words[2 * k + 1]) > 0.0
                            && (double)p[j + k] <= m.bound * uniform(words[2 * k], words[2 * k + 1]));
            for (k = 0; k < n; k++)
                if (keep[k]) consider(&m, p[j + k], uniform(words[2 * k], words[2 * k + 1]), j + k);
            s.pos += 2 * n;
            j += n;
        }
        out[r] = m.index;
    }
    *pos = s.pos;
}
"""


@lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled C draw (built once per machine and compiler into the cache: native.py), or None where no C
    compiler works; the result is checked against torch's own draw before it is trusted."""
    try:
        # No -ffast-math and no contraction: every rounding must be ATen's (log1p is libm's, as ATen's).
        library = native.compiled(
            "exponential_argmax", C_SOURCE, ["-O3", "-march=native", "-std=c99", "-ffp-contract=off"]
        )
    except native.NoCompiler:
        logger.warning(
            "the native draw is not offered here: no C compiler (CC, cc or gcc); the decode kernel plan "
            "chooses among the other draws (the same tokens)"
        )
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning(
            "the native draw is not offered here: building or loading it failed (%s); the decode kernel "
            "plan chooses among the other draws (the same tokens)",
            exc,
        )
        return None
    library.exponential_argmax.restype = None
    library.exponential_argmax.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    if not _agrees_with_torch(lambda probs: _native_draw(library, probs)):
        logger.warning("the native sampler disagrees with torch.multinomial on this machine; not used")
        return None
    return library


def _native_draw(library: ctypes.CDLL, probs: torch.Tensor) -> torch.Tensor:
    p = probs.contiguous()
    key, pos, raw = twister_state()
    position = ctypes.c_int64(pos)
    out = torch.empty(p.shape[0], dtype=torch.long)
    library.exponential_argmax(
        key.ctypes.data, ctypes.addressof(position), p.data_ptr(), p.shape[0], p.shape[1], out.data_ptr()
    )
    set_twister_state(key, position.value, raw)
    return out


def draw_native(probs: torch.Tensor) -> torch.Tensor:
    """The torch draw, in one C loop that skips the logarithm where an entry cannot win."""
    library = native_library() if _emulable(probs) else None
    return draw_torch(probs) if library is None else _native_draw(library, probs)


def _agrees_with_torch(draw) -> bool:
    """A self-check before the compiled draw is trusted: the same tokens and generator state as torch, on a few
    draws (a compiler's rounding, not torch's layout: that is torch_internals.check_generator_state's)."""
    probs = torch.softmax(torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        torch.rand(5)  # start mid-block
        expected, state = draw_torch(probs), torch.get_rng_state()
        torch.manual_seed(1234)
        torch.rand(5)
        return torch.equal(draw(probs), expected) and torch.equal(torch.get_rng_state(), state)


DRAWS = {"torch": draw_torch, "numpy": draw_numpy, "native": draw_native}


def available_draws() -> list[str]:
    """The alternatives that can run here: torch's everywhere; the emulations where torch's generator is as they
    expect (paths.py, "draw"); the native one where it also compiles. The decode kernel plan chooses among these and
    records its choice, so a run that planned an emulation and resumes where it cannot run says so."""
    if not paths.usable("draw"):
        return ["torch"]
    return [name for name in DRAWS if name != "native" or native_library() is not None]
