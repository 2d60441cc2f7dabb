"""Float32 products and sums with IEEE rounding and gradual underflow on every platform.

XLA on CPU flushes float32 subnormals, as operands and as results (docs/numerics.md,
"Platform notes: subnormals on CPU"). Where a quantizer's result depends on arithmetic
among values that may be subnormal (4/6's reconstruction errors, FP8 block's decoded
values), these functions compute it as IEEE 754 does: compiled for CUDA, which keeps
subnormals, they are the plain operations; elsewhere the exact result is formed on the
significands as integers and rounded once by ``division.rounded_magnitude``, as
``division.ieee_div`` divides. Zeros, infinities and NaN give IEEE's results (NaN as the
canonical quiet NaN).
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics.division import ieee_div, normalized, rounded_magnitude

_SIGN = np.uint32(0x80000000)
_INF = np.uint32(0x7F800000)
_NAN = np.uint32(0x7FC00000)
_HIDDEN = np.uint32(0x800000)
_GUARD_BITS = 3  # below a sum's significands: guard, round and sticky


def _bits(x):
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _float(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def _significand_product(sig_a, sig_b):
    """(q in [2^24, 2^25), shift, sticky) with sig_a x sig_b (each in [2^23, 2^24)) equal to
    (q + a remainder below one unit, nonzero where sticky) x 2^shift. The 48-bit product is
    summed from four products of 12-bit halves, each exact in uint32."""
    a_hi, a_lo = sig_a >> 12, sig_a & 0xFFF
    b_hi, b_lo = sig_b >> 12, sig_b & 0xFFF
    middle = a_hi * b_lo + a_lo * b_hi  # below 2^25
    low = a_lo * b_lo + ((middle & 0xFFF) << 12)  # below 2^25
    high = a_hi * b_hi + (middle >> 12) + (low >> 24)  # product = high x 2^24 + low mod 2^24
    low = low & 0xFFFFFF
    top = high >> 23  # 1 when the product is at least 2^47
    shift = 22 + top
    q = (high << (2 - top)) | (low >> shift)
    return q, shift, (low & ((jnp.uint32(1) << shift) - 1)) != 0


def ieee_mul(a, b):
    """a * b for float32 a, b, rounded to nearest even with gradual underflow, from integer
    operations only."""
    a_bits, b_bits = _bits(a), _bits(b)
    sign = (a_bits ^ b_bits) & _SIGN
    a_mag, b_mag = a_bits & ~_SIGN, b_bits & ~_SIGN
    sig_a, exp_a = normalized(a_mag)  # |a| = sig_a x 2^(exp_a - 23)
    sig_b, exp_b = normalized(b_mag)
    q, shift, sticky = _significand_product(sig_a, sig_b)
    # |a b| = q x 2^(shift + exp_a + exp_b - 46) = q x 2^(exponent - 24)
    magnitude = rounded_magnitude(q, exp_a + exp_b + shift.astype(jnp.int32) - 22, sticky)

    a_nan, b_nan = a_mag > _INF, b_mag > _INF
    a_inf, b_inf = a_mag == _INF, b_mag == _INF
    a_zero, b_zero = a_mag == 0, b_mag == 0
    nan = a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf)
    magnitude = jnp.where(a_inf | b_inf, _INF, jnp.where(a_zero | b_zero, jnp.uint32(0), magnitude))
    return _float(jnp.where(nan, _NAN, sign | magnitude))


def _field_significand(magnitude):
    """(significand, exponent field) with |x| = sig x 2^(field - 150): a subnormal's field
    counts as 1, as its spacing is the smallest normal binade's."""
    biased = magnitude >> 23
    sig = jnp.where(biased > 0, (magnitude & 0x7FFFFF) | _HIDDEN, magnitude & 0x7FFFFF)
    return sig, jnp.maximum(biased, 1).astype(jnp.int32)


def ieee_add(a, b):
    """a + b for float32 a, b, rounded to nearest even with gradual underflow, from integer
    operations only: the smaller operand's significand is aligned to the larger's with
    three guard bits, the last of them sticky, which rounds a sum as the exact sum rounds."""
    a_bits, b_bits = _bits(a), _bits(b)
    a_mag, b_mag = a_bits & ~_SIGN, b_bits & ~_SIGN
    swap = b_mag > a_mag  # magnitudes order as their bits do
    big_bits = jnp.where(swap, b_bits, a_bits)
    sig_big, field_big = _field_significand(jnp.where(swap, b_mag, a_mag))
    sig_small, field_small = _field_significand(jnp.where(swap, a_mag, b_mag))
    distance = jnp.clip(field_big - field_small, 0, 31).astype(jnp.uint32)
    small = sig_small << _GUARD_BITS
    aligned = (small >> distance) | ((small & ((jnp.uint32(1) << distance) - 1)) != 0).astype(jnp.uint32)
    big = sig_big << _GUARD_BITS
    total = jnp.where(((a_bits ^ b_bits) & _SIGN) != 0, big - aligned, big + aligned)
    # |a + b| = total x 2^(field_big - 153); its leading bit moved to bit 24 of q
    length = 32 - lax.clz(total).astype(jnp.int32)
    right = jnp.clip(length - 25, 0, 31).astype(jnp.uint32)
    left = jnp.clip(25 - length, 0, 31).astype(jnp.uint32)
    q = (total >> right) << left
    sticky = (total & ((jnp.uint32(1) << right) - 1)) != 0
    magnitude = rounded_magnitude(q, length + field_big - 154, sticky)
    # an exact zero is +0, or -0 when both operands are -0
    out = jnp.where(total == 0, a_bits & b_bits & _SIGN, (big_bits & _SIGN) | magnitude)

    a_nan, b_nan = a_mag > _INF, b_mag > _INF
    a_inf, b_inf = a_mag == _INF, b_mag == _INF
    nan = a_nan | b_nan | (a_inf & b_inf & (((a_bits ^ b_bits) & _SIGN) != 0))
    out = jnp.where(a_inf, a_bits, jnp.where(b_inf, b_bits, out))
    return _float(jnp.where(nan, _NAN, out))


def negated(x):
    """-x by its sign bit."""
    return _float(_bits(x) ^ _SIGN)


def magnitude(x):
    """|x| by its sign bit."""
    return _float(_bits(x) & ~_SIGN)


def _materialized(f):
    """f's result behind a barrier: XLA on CPU would otherwise fuse its long integer
    computation into each consumer, compiling (and running) it again in every one."""
    return lambda *args: lax.optimization_barrier(f(*args))


# The platform's choice jitted: called eagerly (a decode outside jit), the integer work is
# one compiled program, not dozens of operations compiled and dispatched one by one.
@jax.jit
def mul(a, b):
    """a * b with gradual underflow: the plain product where lowered for CUDA, ``ieee_mul``
    elsewhere."""
    return lax.platform_dependent(_f32(a), _f32(b), default=_materialized(ieee_mul), cuda=operator.mul)


@jax.jit
def add(a, b):
    """a + b with gradual underflow: the plain sum where lowered for CUDA, ``ieee_add`` elsewhere."""
    return lax.platform_dependent(_f32(a), _f32(b), default=_materialized(ieee_add), cuda=operator.add)


@jax.jit
def sub(a, b):
    """a - b with gradual underflow."""
    difference = _materialized(lambda a, b: ieee_add(a, negated(b)))
    return lax.platform_dependent(_f32(a), _f32(b), default=difference, cuda=operator.sub)


@functools.partial(jax.jit, static_argnums=1)
def div(a, b):
    """a / b for a constant b (static, so that it stays a constant) with gradual underflow:
    ``division.ieee_div`` on every platform, materialized on CPU."""
    a = _f32(a)
    return lax.platform_dependent(a, default=_materialized(lambda a: ieee_div(a, b)),
                                  cuda=lambda a: ieee_div(a, b))


def less_non_negative(a, b):
    """a < b for float32 a, b that are >= 0 or NaN (False where either is NaN), on their
    magnitudes' bits: CPU compares a subnormal as 0."""
    a_mag, b_mag = _bits(a) & ~_SIGN, _bits(b) & ~_SIGN
    return (a_mag < b_mag) & (a_mag <= _INF) & (b_mag <= _INF)
