"""Quantization statistics of one GEMM operand, in JAX (docs/telemetry.md).

``operand_stats(t, spec, axis, key)`` quantizes ``t`` exactly as the quantized dot_general
does for that operand (the RHT first where the spec says, the same ``quantize`` call, the
same block layout along ``axis``, the contraction axis of the GEMM that consumes it) and
returns a float32 vector of STATS:

- ``amax``: max |t| (NaN-propagating, as the quantizer's own amax);
- ``underflow``: fraction of the finite non-zero inputs that quantize to zero (element
  code 0, or an NVFP4 block scale of 0; inputs lost to a NaN block are not counted here);
- ``saturation``: fraction of the finite non-zero inputs stored at the element format's
  largest magnitude (448 E4M3, 57344 E5M2, 6 E2M1);
- ``sqnr_db``: 10 log10(sum t^2 / sum (t - dequantized)^2) over the finite inputs; +inf
  when the copy is exact (an all-zero tensor included), -inf when a finite input came back
  non-finite (an MXFP8 block sharing a NaN);
- ``scale_exp_min`` / ``scale_exp_max``: the smallest and largest base-2 exponent of the
  scales used (E8M0: code - 127; E4M3 block scales and the FP8 per-tensor scale_inv:
  floor(log2)), over the blocks whose amax is finite and non-zero (NaN when there is none);
- ``scale_at_limit``: fraction of those blocks whose scale sits at its format's limit:
  E8M0 code 0 or 254; an NVFP4 E4M3 block scale below the normal range (2^-6: subnormal or
  flushed to 0; the top of the range, 448, is where the tensor scale puts the largest
  block by design, so it is not counted); the FP8 per-tensor scale clamped to FLT_MAX.

All counts are exact integers in int32, so the fractions are exact up to one float32
division; tests/test_quant_stats.py checks every statistic against NumPy.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from lp_jax.gemm.operands import quantize_kwargs, transformed
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import (MX_BLOCK, NVFP4_BLOCK, abs_max, block_values, dequantize,
                                      quantize, tensor_scale_fp8, to_blocks, to_tiles)

STATS = ("amax", "underflow", "saturation", "sqnr_db", "scale_exp_min", "scale_exp_max",
         "scale_at_limit")
E4M3_MIN_NORMAL = 2.0 ** -6
E8M0_LIMIT_CODES = (0, 254)


def _floor_log2(s):
    """floor(log2 s) of positive finite float32 values, from the bits (exact for subnormal
    values too, which arithmetic on CPU may flush to zero)."""
    bits = F.f32_bits(s)
    biased = (bits >> 23).astype(jnp.int32) & 0xFF
    mantissa = bits & jnp.uint32(0x7FFFFF)
    subnormal = (31 - lax.clz(mantissa).astype(jnp.int32)) - 149
    return jnp.where(biased == 0, subnormal, biased - 127).astype(jnp.float32)


def _fraction(count, total):
    return count.astype(jnp.float32) / jnp.maximum(total, 1).astype(jnp.float32)


def _sqnr_db(t, deq):
    """SQNR of deq against t over t's finite elements (see the module docstring)."""
    finite = jnp.isfinite(t)
    scale = jnp.max(jnp.where(finite, jnp.abs(t), 0))
    scale = jnp.where(scale > 0, scale, 1)  # normalized so the sums cannot overflow
    signal = jnp.sum(jnp.where(finite, jnp.square(t / scale), 0))
    # Each side scaled before the difference: a difference of tiny values would be a
    # float32 subnormal, which CPU arithmetic flushes to zero.
    err = jnp.where(finite, t / scale - deq / scale, 0)
    lost = jnp.any(finite & ~jnp.isfinite(deq))
    noise = jnp.sum(jnp.square(jnp.where(lost, 0, err)))
    exact = noise == 0
    db = 10 * jnp.log10(signal / jnp.where(exact, 1, noise))
    return jnp.where(lost, -jnp.inf, jnp.where(exact, jnp.inf, db))


def _block_amax_and_scales(t, q, spec, axis):
    """(amax of each block, that block's scale as float32, exponents, at-limit flags)."""
    if spec.fmt in F.PER_TENSOR_FORMATS:
        amax = abs_max(t)
        scale_inv = q.scale.astype(jnp.float32)
        clamped = tensor_scale_fp8(amax, F.max_of(F.FORMAT_SPECS[spec.fmt].element)) == F.FLT_MAX
        return amax[None], _floor_log2(scale_inv)[None], clamped[None]
    if spec.fmt == "mxfp8":
        amax = abs_max(to_blocks(t, axis, MX_BLOCK), axis=-1)
        code = lax.bitcast_convert_type(jnp.moveaxis(q.scale, axis, -1), jnp.uint8).astype(jnp.int32)
        at_limit = (code == E8M0_LIMIT_CODES[0]) | (code == E8M0_LIMIT_CODES[1])
        return amax, (code - 127).astype(jnp.float32), at_limit
    if spec.block_2d:
        amax = abs_max(to_tiles(t), axis=(-3, -1))
        s_b = q.scale.astype(jnp.float32)
    else:
        amax = abs_max(to_blocks(t, axis, NVFP4_BLOCK), axis=-1)
        s_b = jnp.moveaxis(q.scale, axis, -1).astype(jnp.float32)
    exponent = jnp.where(s_b > 0, _floor_log2(jnp.where(s_b > 0, s_b, 1)), jnp.nan)
    return amax, exponent, s_b < E4M3_MIN_NORMAL


def _stored_zero(q):
    """Where the GEMM multiplies a zero: the element code is 0, or (NVFP4) its block scale
    is. Read from the codes, not the dequantized float32, whose last multiplication by a
    tiny tensor scale could itself underflow."""
    if q.fmt != "nvfp4":
        return q.data.astype(jnp.float32) == 0
    return block_values(q) == 0  # q * s_b, exact: both factors are at least 2^-10


def operand_stats(t, spec, axis: int, key=None):
    """float32 [len(STATS)] for 2-D operand ``t`` quantized by ``spec`` along ``axis``.
    ``key``: the stochastic-rounding key, needed when ``spec.stochastic``."""
    if spec.fmt is None:
        raise ValueError("operand_stats: a BF16 operand is not quantized")
    t = transformed(t, spec, axis)
    q = quantize(t, spec.fmt, axis=axis, **quantize_kwargs(spec, key))
    tf = t.astype(jnp.float32)
    deq = dequantize(q)
    nonzero = jnp.isfinite(tf) & (tf != 0)
    n_nonzero = jnp.sum(nonzero, dtype=jnp.int32)
    kept = nonzero & jnp.isfinite(deq)  # not lost to a NaN block (MXFP8), where codes mean nothing
    underflow = _fraction(jnp.sum(kept & _stored_zero(q), dtype=jnp.int32), n_nonzero)
    fmax = F.max_of(F.FORMAT_SPECS[spec.fmt].element)
    stored = jnp.abs(q.data.astype(jnp.float32))
    saturation = _fraction(jnp.sum(kept & (stored == fmax), dtype=jnp.int32), n_nonzero)
    amax_b, exponent, at_limit = _block_amax_and_scales(tf, q, spec, axis)
    used = jnp.isfinite(amax_b) & (amax_b > 0)
    has_exp = used & ~jnp.isnan(exponent)
    any_exp = jnp.any(has_exp)
    exp_min = jnp.where(any_exp, jnp.min(jnp.where(has_exp, exponent, jnp.inf)), jnp.nan)
    exp_max = jnp.where(any_exp, jnp.max(jnp.where(has_exp, exponent, -jnp.inf)), jnp.nan)
    limit = _fraction(jnp.sum(used & at_limit, dtype=jnp.int32), jnp.sum(used, dtype=jnp.int32))
    return jnp.stack([abs_max(tf), underflow, saturation, _sqnr_db(tf, deq), exp_min, exp_max,
                      limit]).astype(jnp.float32)
