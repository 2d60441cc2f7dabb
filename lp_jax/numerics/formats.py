"""Element formats and the exact float32 bit manipulations the scaling rules need.

Pure jnp on float32, following docs/numerics.md. Every cast saturates (``cast_satfinite``),
and E8M0 codes are built from exponent bits, never cast. Results stay exact where XLA on CPU
flushes float32 subnormals to zero, and where an older XLA folds consecutive float constant
factors into one (docs/jax_versions.md): powers of two are applied as two normal factors, and
no two constant factors follow each other unless their product is a normal float32.
The quantized formats made of these elements are objects of ``lp_jax.numerics.registry``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics.division import div, rne_shift_right

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
# itself is flushed to zero on CPU.
RCEIL_CODE0_MAX_AMAX = np.uint32(0x04600001).view(np.float32)


def max_of(dtype) -> float:
    return _FMAX[jnp.dtype(dtype).type]


def cast_satfinite(x, dtype):
    """Round to nearest even, saturating to +-max; NaN stays NaN (E4M3, E5M2, E2M1)."""
    fmax = max_of(dtype)
    return jnp.clip(x, -fmax, fmax).astype(dtype)


def exact_f32(x):
    """x (bf16 or f32) in float32, bf16 widened through its bits. The same values as
    ``x.astype(float32)``, but XLA's GPU compiler, which may drop a float32 -> bf16 -> float32
    round trip (excess precision), cannot see one here: a quantizer then reads the rounded
    bf16 tensor its producer wrote, not the producer's float32 value (which XLA would also
    have to write, at twice the bytes)."""
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


def f32_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def exp2_int(k):
    """2.0**k in float32 for integer k in [-126, 127], built from exponent bits."""
    k = jnp.asarray(k, jnp.int32)
    return lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def exp2_factors(k):
    """(f1, f2), two normal float32 powers of two with f1 * f2 = 2**k, for integer k in
    [-254, 254]: ``x * f1 * f2`` is ``mul_exp2(x, k)``, for factors computed once per block."""
    k = jnp.asarray(k, jnp.int32)
    half = k // 2
    return exp2_int(half), exp2_int(k - half)


def mul_exp2(x, k):
    """x * 2**k for integer k in [-254, 254], exactly (two normal power-of-two factors).

    A single factor 2**-127 would be subnormal and flushed to zero on CPU. The quantizers
    pass a k computed from data; a k known when tracing makes both factors constants,
    which XLA before 0.12 multiplies into one (2^-140 subnormal, flushed; 2^200 inf), so
    the barrier keeps such constants apart (see ``mul``).
    """
    known = not isinstance(k, jax.core.Tracer)
    f1, f2 = exp2_factors(k)
    if known:
        f1, f2 = lax.optimization_barrier((f1, f2))
    return x * f1 * f2


# ---------------------------------------------------------------- subnormal-exact helpers
# Scale factors such as 1/FLT_MAX are float32 subnormals. XLA on CPU flushes subnormal
# operands and results to zero, which would zero a whole tensor's dequantized values (or
# push NVFP4 encodings to +-6). These helpers build such values from integer bits, with
# IEEE round-to-nearest-even, and multiply by them through integer mantissas, so every
# result that is itself a normal float32 comes out as IEEE arithmetic would give it.

_TWO_M64 = np.float32(2.0**-64)
_TWO_M23 = np.float32(2.0**-23)
_TWO_126 = np.float32(2.0**126)
_MIN_NORMAL = np.float32(2.0**-126)


def _f32_from_bits(bits):
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _significand(x):
    """(integer significand, exponent) with x = sig * 2^exp, for finite float32 x >= 0."""
    bits = f32_bits(x)
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = bits & 0x7FFFFF
    sig = jnp.where(biased > 0, frac | 0x800000, frac)
    return sig, jnp.where(biased > 0, biased - 150, -149)


def _subnormal_from_scaled_int(p, e):
    """The float32 bits of p * 2^e rounded to the subnormal grid (2^-149), for a value below
    2^-126 (a result of 2^-126 comes out as the smallest normal, as IEEE rounding gives)."""
    shift = jnp.int32(-149) - e
    q = jnp.where(shift > 31, 0, rne_shift_right(p.astype(jnp.uint32), shift))
    return _f32_from_bits(jnp.where(shift <= 0, p.astype(jnp.uint32), q))


def recip(s):
    """1/s for positive, normal, finite float32 s, rounded as IEEE even where subnormal.

    Above 2^126 the reciprocal is subnormal: it is computed as 2^64/s (normal), then moved
    down 64 binades on its integer significand. (This rounds twice; the two roundings can
    only disagree when 2^64/s lies within an ulp of a tie on the coarser subnormal grid.)
    """
    s = s.astype(jnp.float32)
    big = s > _TWO_126
    scaled = div(jnp.float32(1), jnp.where(big, s * _TWO_M64, s))
    sig, exp = _significand(scaled)
    return jnp.where(big, _subnormal_from_scaled_int(sig, exp - 64), scaled)


def mul(x, s):
    """x * s with s a positive float32 scale that may be a subnormal bit pattern.

    For subnormal s = m * 2^-149, x * s = (x * (m * 2^-23)) * 2^-126: the first product
    rounds once (m * 2^-23 is exact, normal and below 1, so it cannot overflow); the
    second step subtracts 126 from the exponent field on integers, exactly, wherever the
    result is normal. A subnormal result, inf or NaN takes a float multiply by the normal
    constant 2^-126 instead (a subnormal result is then flushed on CPU, kept on GPU).

    Integers, not a second float constant: XLA before 0.12 folds two float constant
    factors into one, and a folded subnormal constant is flushed to zero on CPU
    (docs/jax_versions.md).
    """
    bits = f32_bits(s)
    subnormal = ((bits >> 23) & 0xFF) == 0
    y = x * ((bits & 0x7FFFFF).astype(jnp.float32) * _TWO_M23)
    y_bits = f32_bits(y)
    y_exp = (y_bits >> 23) & 0xFF
    down = jnp.where((y_exp > 126) & (y_exp < 255), _f32_from_bits(y_bits - (126 << 23)), y * _MIN_NORMAL)
    return jnp.where(subnormal, down, x * s)


def nvfp4_encode_factor(s_b, s_dec):
    """enc_b = min(1 / (s_b * S_dec), FLT_MAX), exact even where the product is subnormal.

    s_b: float32 values of E4M3 block scales (4 significant bits); s_dec: float32, maybe a
    subnormal bit pattern. A normal product comes from ``mul``; a subnormal one is formed on
    integers (4 x 24 bits) and rounded to the 2^-149 grid; its reciprocal is taken 64
    binades up and scaled back (overflowing to inf, then clamped, as IEEE would).
    """
    s_b = s_b.astype(jnp.float32)
    p_normal = mul(s_b, s_dec)
    sig_b, exp_b = _significand(s_b)
    sig_d, exp_d = _significand(s_dec)
    p_sub = _subnormal_from_scaled_int((sig_b >> 20) * sig_d, exp_b + 20 + exp_d)
    small = p_normal < _MIN_NORMAL  # the product is subnormal (or zero)
    up = (f32_bits(p_sub) & 0xFFFFFF).astype(jnp.float32) * np.float32(2.0**-85)  # p * 2^64
    enc_small = div(jnp.float32(1), up) * np.float32(2.0**32) * np.float32(2.0**32)  # inf if > max
    enc = jnp.where(small, enc_small, div(jnp.float32(1), p_normal))
    return jnp.minimum(enc, jnp.float32(FLT_MAX))


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

    The two 32-bit seeds are the key's own data (a key from ``fold_in`` is already a
    threefry output, and lp_jax derives one per call site and operand); each element's bits
    are a hash of its index and the seeds, as TE's kernels derive per-thread bits from a
    seed and an offset. This is elementwise integer work that fuses into the quantization
    kernel, where threefry output per element would cost far more (docs/numerics.md).
    """
    n = int(np.prod(shape)) if shape else 1
    return uniform_from_index(sr_seeds(key), lax.iota(jnp.uint32, n).reshape(shape))


def sr_seeds(key):
    """The two uint32 seeds of a key's stochastic-rounding bits (its own data)."""
    return jax.random.key_data(key).reshape(-1)[-2:].astype(jnp.uint32)


def uniform_from_index(seeds, idx):
    """The noise ``uniform_from_counter`` gives the element at flat index ``idx`` (uint32):
    what a kernel that sees one tile of the layout draws for its elements."""
    h = _fmix32(_fmix32(idx * jnp.uint32(0x9E3779B9) + seeds[0]) ^ seeds[1])
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _noise(key, shape):
    """SR noise for an array of ``shape``: from a JAX key (bits by place in that array), or
    from ``key(shape)`` when key is a function (a Pallas kernel's tile of the whole array)."""
    return key(shape) if callable(key) else uniform_from_counter(key, shape)


def e2m1_from_codes(code):
    """float4_e2m1fn from 4-bit codes held in an unsigned integer (``e2m1_codes``), by a bitcast.

    XLA's f32 -> f4e2m1fn convert is a slow generic routine on CPU; building the 4-bit
    code and bitcasting it is faster and gives the same bits (tests compare).
    """
    return lax.bitcast_convert_type(code.astype(jnp.uint4), E2M1)


def _e2m1_code_nearest(a):
    """Magnitude code 0..7 (as float32) of |v| = a, rounded to nearest even.

    The E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 have spacing 0.5 below 2 (codes 0..4),
    1 in [2, 4) (codes 4..6) and 2 in [4, 6] (codes 6, 7); scaling by a power of two is exact
    and jnp.round ties to even.
    """
    return jnp.where(a < 2, jnp.round(a * 2), jnp.where(a < 4, jnp.round(a) + 2, jnp.round(a * 0.5) + 4))


def _floor_non_negative(s):
    """floor(s) for float32 s >= 0 or NaN (kept), through an int32 round trip: the same values
    as jnp.floor there, and it lowers in a Pallas kernel (Mosaic GPU has no floor rule)."""
    return jnp.where(s != s, s, s.astype(jnp.int32).astype(jnp.float32))


def _e2m1_code_stochastic(a, key):
    """Magnitude code of a = |v| rounded up with probability (a - lo) / (hi - lo)."""
    scaled = jnp.where(a < 2, a * 2, jnp.where(a < 4, a, a * 0.5))
    offset = jnp.where(a < 2, 0.0, jnp.where(a < 4, 2.0, 4.0))
    lo = _floor_non_negative(scaled)
    up = _noise(key, a.shape) < scaled - lo
    return lo + offset + up.astype(jnp.float32)


def _e2m1_code(v, rounding, key):
    a = jnp.abs(v)
    return _e2m1_code_stochastic(a, key) if rounding == "stochastic" else _e2m1_code_nearest(a)


def e2m1_codes(v, rounding="nearest", key=None):
    """The 4-bit E2M1 codes (magnitude code | sign << 3, in uint32) of float32 v (clipped to
    [-6, 6]) rounded to nearest even, or stochastically with key.

    Integer work in 32 bits, the sign taken from v's bits (as ``signbit``, with no boolean in
    between): a Pallas kernel's Mosaic GPU lowering refuses arithmetic on 8-bit values and a
    conversion to booleans held one per thread."""
    return _e2m1_code(v, rounding, key).astype(jnp.uint32) | ((f32_bits(v) >> 31) << 3)


def e2m1_round(v, rounding="nearest", key=None):
    """v (clipped to [-6, 6]) rounded to E2M1 (nearest even, or stochastic with key)."""
    return e2m1_from_codes(e2m1_codes(v, rounding, key))


def e2m1_round_values(v, rounding="nearest", key=None):
    """The float32 values of ``e2m1_round(v, ...)``, computed without any fp4 convert.

    Arithmetic rounding leaves XLA no f32 -> fp4 -> f32 convert pair it could fold away as
    excess precision, so a GEMM operand built this way needs no barrier and fuses freely.
    """
    mag = _e2m1_code(v, rounding, key)
    value = jnp.where(mag < 4, mag * 0.5, jnp.where(mag < 6, mag - 2, (mag - 4) * 2))
    return jnp.where(jnp.signbit(v), -value, value)
