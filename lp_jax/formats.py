"""Element formats and the exact float32 bit manipulations the scaling rules need.

Everything here is pure jnp on float32 and follows docs/numerics.md (the shared numerics
contract). Two facts shape the code:

- ``astype`` to E4M3/E5M2 does not saturate (overflow becomes NaN/inf), so every cast goes
  through ``cast_satfinite``; ``astype`` to E8M0 rounds to nearest, so E8M0 codes are built
  from exponent bits and bitcast, never cast.
- XLA on CPU flushes float32 subnormals to zero in arithmetic. The code avoids products that
  could be subnormal where the result would differ (powers of two are applied in two halves;
  the one subnormal case of the MXFP8 scale rule is decided by a precomputed threshold).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E2M1 = jnp.float4_e2m1fn
E8M0 = jnp.float8_e8m0fnu

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
FLT_MAX = float(np.finfo(np.float32).max)

_FMAX = {E4M3: E4M3_MAX, E5M2: E5M2_MAX, E2M1: E2M1_MAX}

# fp32(1/448), the RCEIL multiplier. TE multiplies by this rounded reciprocal rather than
# dividing by 448, and the rounding decides codes when amax/448 is one ulp above 2^k.
INV_E4M3_MAX = np.float32(1) / np.float32(448)
# The largest float32 amax whose product with INV_E4M3_MAX rounds (on the subnormal grid)
# to at most 2^-127, i.e. to a subnormal mantissa <= 0x400000: those blocks get code 0, the
# rest of the subnormal range code 1. Precomputed exactly (fractions) because the product
# itself is flushed to zero on CPU. tests/test_formats.py re-derives it.
RCEIL_CODE0_MAX_AMAX = np.uint32(0x04600001).view(np.float32)


def max_of(dtype) -> float:
    return _FMAX[jnp.dtype(dtype).type]


def cast_satfinite(x, dtype):
    """Round to nearest even, saturating to +-max; NaN stays NaN (E4M3, E5M2, E2M1)."""
    fmax = max_of(dtype)
    return jnp.clip(x, -fmax, fmax).astype(dtype)


def f32_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def exp2_int(k):
    """2.0**k in float32 for integer k in [-126, 127], built from exponent bits."""
    k = jnp.asarray(k, jnp.int32)
    return lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def mul_exp2(x, k):
    """x * 2**k for integer k in [-254, 254], exactly (two normal power-of-two factors).

    A single factor 2**-127 would be subnormal and flushed to zero on CPU.
    """
    k = jnp.asarray(k, jnp.int32)
    half = k // 2
    return x * exp2_int(half) * exp2_int(k - half)


def e8m0_from_code(code):
    return lax.bitcast_convert_type(code.astype(jnp.uint8), E8M0)


def e8m0_code_rceil(amax):
    """E8M0 code of TE's RCEIL rule: ceil(log2(amax * fp32(1/448))) + 127, from bits.

    d = amax * fp32(1/448); code = biased exponent of d, plus one if d's mantissa is
    non-zero; FP32-subnormal d with mantissa <= 0x400000 gets 0. Zero -> 0, NaN -> 255,
    inf -> 254. Never a float ceil(log2()), which is one too low one ulp above 2^k.
    """
    amax = amax.astype(jnp.float32)
    bits = f32_bits(amax * INV_E4M3_MAX)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    code = biased + (mantissa != 0).astype(jnp.uint32)
    # d subnormal (flushed to 0 on CPU, kept on GPU): 0 or 1 by the exact threshold.
    code = jnp.where(amax <= RCEIL_CODE0_MAX_AMAX, 0, jnp.maximum(code, 1))
    code = jnp.where(jnp.isinf(amax), 254, code)
    code = jnp.where(jnp.isnan(amax), 255, code)
    return code.astype(jnp.uint8)


def e8m0_code_floor(amax):
    """E8M0 code of the OCP v1.0 rule: X = 2^(floor(log2 amax) - 8), clamped at code 0.

    floor(log2 amax) is the unbiased exponent of amax (a subnormal amax gives a negative
    code, clamped to 0). Zero -> 0, NaN -> 255, inf -> 254, as RCEIL.
    """
    amax = amax.astype(jnp.float32)
    biased = ((f32_bits(amax) >> 23) & 0xFF).astype(jnp.int32)
    code = jnp.clip(biased - 8, 0, 254)
    code = jnp.where(jnp.isinf(amax), 254, code)
    code = jnp.where(jnp.isnan(amax), 255, code)
    return code.astype(jnp.uint8)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_from_counter(key, shape):
    """Uniform [0, 1) float32 noise (24 bits) for stochastic rounding, from a JAX key.

    Two 32-bit seeds come from ``key`` (threefry); each element's bits are a hash of its
    index and the seeds, as TE's kernels derive per-thread bits from a seed and an offset.
    This is elementwise integer work that fuses into the quantization kernel: drawing the
    same amount of threefry output costs several times the whole quantization on CPU.
    """
    seed = jax.random.bits(key, (2,), jnp.uint32)
    n = int(np.prod(shape)) if shape else 1
    idx = lax.iota(jnp.uint32, n).reshape(shape)
    h = _fmix32(_fmix32(idx * jnp.uint32(0x9E3779B9) + seed[0]) ^ seed[1])
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def e2m1_stochastic(v, key):
    """Stochastic rounding of v (already clipped to [-6, 6]) to E2M1.

    |v| between adjacent E2M1 values lo < hi rounds up with probability (|v|-lo)/(hi-lo);
    the sign is kept. The E2M1 grid has spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
    """
    a = jnp.abs(v)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    lo = jnp.floor(a / step) * step  # exact: step is a power of two
    frac = (a - lo) / step
    u = uniform_from_counter(key, v.shape)
    up = jnp.minimum(lo + step, E2M1_MAX)
    rounded = jnp.where(u < frac, up, lo)
    rounded = jnp.where(jnp.isnan(v), v, rounded)
    return (jnp.sign(v) * rounded).astype(E2M1)
