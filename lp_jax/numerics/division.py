"""Float32 division rounded as IEEE rounds it, on every platform lp_jax compiles for.

The quantizers' scales are quotients (FP8-CS's ``448 / amax``, NVFP4's ``2688 / amax`` and
``1 / (s_b * S_dec)``, FP8 block's per-block ``448 / amax``, 4/6's reconstructions), and a
scale one ulp off moves the codes of elements near a rounding boundary. XLA on CPU divides
as IEEE does. Compiled for an NVIDIA GPU, XLA divides by ``div.full.f32`` (up to 2 ulp off)
and takes reciprocals by ``rcp.approx.f32``, and Mosaic GPU (the Pallas kernels) does the
same; XLA's only switch for it, an LLVM option in ``XLA_FLAGS``, also reaches XLA's CPU
compiler, which since JAX 0.12.1 exits on an option it does not know. So where the program
is lowered for CUDA, ``div`` divides the significands on integers instead: integer
operations are exact on every device, and 25 quotient bits (the leading one, then 8 per
uint32 division), the remainder's sticky bit and ties to even give the IEEE quotient,
subnormal operands and results included. A divisor known when tracing (4/6's per-element
``/ 1536``) stays a constant: XLA folds its half, and divides by it with multiplies.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_SIGN = np.uint32(0x80000000)
_INF = np.uint32(0x7F800000)
_NAN = np.uint32(0x7FC00000)
_HIDDEN = np.uint32(0x800000)  # the implicit leading bit of a normal significand
_CHUNK_BITS = 8  # quotient bits per integer division step

_INTEGER_DIVISION = contextvars.ContextVar("lp_jax_integer_division", default=False)


@contextlib.contextmanager
def integer_division() -> Iterator[None]:
    """``div`` traced inside divides on integers whatever the platform: for Pallas kernel
    bodies lowered by Mosaic GPU, which have no per-platform branches of their own. (A
    function jitted before and called inside keeps the trace jit cached for it.)"""
    token = _INTEGER_DIVISION.set(True)
    try:
        yield
    finally:
        _INTEGER_DIVISION.reset(token)


def div(a, b):
    """a / b in float32 with IEEE rounding: XLA's division on CPU and elsewhere, integer long
    division (``ieee_div``) where lowered for CUDA or inside ``integer_division``."""
    a = jnp.asarray(a, jnp.float32)
    if _INTEGER_DIVISION.get():
        return ieee_div(a, b)
    if not isinstance(b, jax.core.Tracer) and np.ndim(b) == 0:
        # kept a constant: XLA folds its half of ieee_div, and divides by a constant faster
        b = np.float32(b)
        return lax.platform_dependent(a, default=lambda a: a / b, cuda=lambda a: ieee_div(a, b))
    a, b = jnp.broadcast_arrays(a, jnp.asarray(b, jnp.float32))
    return lax.platform_dependent(a, b, default=operator.truediv, cuda=ieee_div)


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def normalized(magnitude):
    """(significand with bit 23 set, exponent e) with |x| = sig * 2^(e - 23), for the bits of
    a finite nonzero |x|; a subnormal's significand is shifted up by its leading zeros."""
    biased = (magnitude >> 23).astype(jnp.int32)
    fraction = magnitude & 0x7FFFFF
    sig = jnp.where(biased > 0, fraction | _HIDDEN, fraction)
    shift = lax.clz(sig) - 8  # 0 for a normal significand; 24 for zero, which is special-cased
    return sig << shift, jnp.maximum(biased, 1) - 127 - shift.astype(jnp.int32)


def rne_shift_right(q, shift, sticky=False):
    """uint32 q >> shift rounded to nearest, ties to even, shift clipped to [1, 31];
    ``sticky`` says where nonzero bits below q (a division's remainder) were dropped already."""
    shift = jnp.clip(shift, 1, 31).astype(jnp.uint32)
    kept = q >> shift
    dropped = q & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    up = (dropped > half) | ((dropped == half) & (sticky | ((kept & 1) == 1)))
    return kept + up.astype(jnp.uint32)


def _long_division(sig_a, exp_a, sig_b, exp_b):
    """(q in [2^24, 2^25), exponent, sticky) with sig_a 2^exp_a / (sig_b 2^exp_b) equal to
    q 2^(exponent - 24) plus a remainder below one unit of q that is nonzero where sticky.
    The 24 bits after the leading one come 8 at a time from exact uint32 divisions: a
    remainder below sig_b < 2^24 shifted by 8 still fits 32 bits."""
    below = (sig_a < sig_b).astype(jnp.uint32)  # so that sig_b <= r < 2 sig_b: a leading 1
    r = (sig_a << below) - sig_b
    q = _HIDDEN << 1
    for shift in range(24 - _CHUNK_BITS, -1, -_CHUNK_BITS):
        chunk = (r << _CHUNK_BITS) // sig_b
        r = (r << _CHUNK_BITS) - chunk * sig_b
        q = q | (chunk << shift)
    return q, exp_a - exp_b - below.astype(jnp.int32), r != 0


def rounded_magnitude(q, exponent, sticky):
    """The float32 bits of q * 2^(exponent - 24) rounded to nearest even (q in [2^24, 2^25),
    ``sticky`` where nonzero bits below q were dropped): a normal number, a subnormal one on
    the grid of 2^-149, or inf where it overflows. How ``ieee_div`` and the products and sums
    of ``gradual_underflow`` round their exact results."""
    normal = rne_shift_right(q, jnp.ones_like(exponent), sticky)  # 2^23 <= normal <= 2^24
    carry = normal >> 24  # rounded up to 2^24: one binade up
    biased = exponent + 127 + carry.astype(jnp.int32)
    normal_bits = (jnp.clip(biased, 1, 254).astype(jnp.uint32) << 23) | ((normal >> carry) & 0x7FFFFF)
    # below 2^-126: q * 2^(exponent - 24) on the grid of 2^-149 is q >> (-exponent - 125)
    # (0 from a shift of 26 up, q being below 2^25)
    tiny = rne_shift_right(q, -exponent - 125, sticky)
    return jnp.where(biased > 254, _INF, jnp.where(exponent < -126, tiny, normal_bits))


def ieee_div(a, b):
    """a / b for float32 a, b, rounded to nearest even as IEEE 754 divides, from integer
    operations only: the same bits on CPU, GPU and in Mosaic GPU kernels (no subnormal is
    flushed). Zeros, infinities and NaN give IEEE's results (NaN as the canonical quiet NaN)."""
    # not broadcast: a constant b stays a scalar constant, whose half XLA folds
    a_bits, b_bits = _bits(jnp.asarray(a, jnp.float32)), _bits(jnp.asarray(b, jnp.float32))
    sign = (a_bits ^ b_bits) & _SIGN
    a_mag, b_mag = a_bits & ~_SIGN, b_bits & ~_SIGN

    magnitude = rounded_magnitude(*_long_division(*normalized(a_mag), *normalized(b_mag)))
    a_nan, b_nan = a_mag > _INF, b_mag > _INF
    a_inf, b_inf = a_mag == _INF, b_mag == _INF
    a_zero, b_zero = a_mag == 0, b_mag == 0
    nan = a_nan | b_nan | (a_inf & b_inf) | (a_zero & b_zero)
    magnitude = jnp.where(a_inf | b_zero, _INF, jnp.where(a_zero | b_inf, jnp.uint32(0), magnitude))
    out = jnp.where(nan, _NAN, sign | magnitude)
    return lax.bitcast_convert_type(out, jnp.float32)
