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

Everything is computed in the blocked layout the quantizer's own kernels work on
([..., blocks, block], zero-padded), calling those kernels (the same rounding, the same
stochastic bits for a given key as the GEMM's decoded operands), with no packing to
low-precision bytes and back: the probe traces 42 of these per layer, so their compile
time counts. Counts are exact int32 sums, so the fractions are exact up to one float32
division; tests/test_quant_stats.py checks every statistic against NumPy.
"""
from __future__ import annotations

import dataclasses

import jax

import jax.numpy as jnp
from jax import lax

from lp_jax.gemm.operands import transformed
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import (MX_BLOCK, NVFP4_BLOCK, abs_max, mxfp8_blocks,
                                      nvfp4_block_encoding, nvfp4_encode_values,
                                      nvfp4_tensor_scale, quantize_per_tensor, tensor_scale_fp8,
                                      to_blocks, to_tiles)

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


@dataclasses.dataclass
class _Blocked:
    """One quantized operand in block layout: the input, the stored element values, the
    dequantized values (all float32, the same shape), and per block its amax, scale
    exponent and whether the scale sits at its limit."""

    t: jax.Array
    stored: jax.Array
    zero: jax.Array  # where the GEMM multiplies a zero: element 0 (or NVFP4 block scale 0)
    deq: jax.Array
    amax: jax.Array
    exponent: jax.Array
    at_limit: jax.Array


def _per_tensor(t, fmt):
    element = F.FORMAT_SPECS[fmt].element
    data, scale_inv = quantize_per_tensor(t, element)
    stored = data.astype(jnp.float32)
    amax = abs_max(t)
    clamped = tensor_scale_fp8(amax, F.max_of(element)) == F.FLT_MAX
    return _Blocked(t, stored, stored == 0, F.mul(stored, scale_inv), amax[None],
                    _floor_log2(scale_inv)[None], clamped[None])


def _mxfp8(t, axis, scale_rule):
    xb = to_blocks(t, axis, MX_BLOCK)
    data, code = mxfp8_blocks(xb, scale_rule)
    stored = data.astype(jnp.float32)
    k = code.astype(jnp.int32)
    deq = jnp.where(k[..., None] == 255, jnp.float32(jnp.nan), F.mul_exp2(stored, k[..., None] - 127))
    at_limit = (k == E8M0_LIMIT_CODES[0]) | (k == E8M0_LIMIT_CODES[1])
    return _Blocked(xb, stored, stored == 0, deq, abs_max(xb, axis=-1),
                    (k - 127).astype(jnp.float32), at_limit)


def _nvfp4(t, axis, block_2d, rounding, key):
    if block_2d:
        xb, amax_axes = to_tiles(t), (-3, -1)
        expand = lambda per_block: per_block[..., :, None, :, None]  # noqa: E731
    else:
        xb, amax_axes = to_blocks(t, axis, NVFP4_BLOCK), -1
        expand = lambda per_block: per_block[..., None]  # noqa: E731
    amax = abs_max(xb, axis=amax_axes)
    s_enc = nvfp4_tensor_scale(abs_max(amax))  # the tensor's amax, from its blocks' (the same bits)
    s_b, enc = nvfp4_block_encoding(amax, s_enc)
    stored = nvfp4_encode_values(xb, expand(enc), rounding, key)
    s_b = s_b.astype(jnp.float32)
    block_values = stored * expand(s_b)  # q * s_b, exact: both factors are at least 2^-10
    exponent = jnp.where(s_b > 0, _floor_log2(jnp.where(s_b > 0, s_b, 1)), jnp.nan)
    return _Blocked(xb, stored, block_values == 0, F.mul(block_values, F.recip(s_enc)), amax,
                    exponent, s_b < E4M3_MIN_NORMAL)


def _blocked(t, spec, axis, key):
    if spec.fmt in F.PER_TENSOR_FORMATS:
        return _per_tensor(t, spec.fmt)
    if spec.fmt == "mxfp8":
        return _mxfp8(t, axis, spec.scale_rule)
    rounding = "stochastic" if spec.stochastic else "nearest"
    if spec.stochastic and key is None:
        raise ValueError("operand_stats: a stochastically rounded operand needs key=")
    return _nvfp4(t, axis, spec.block_2d, rounding, key if spec.stochastic else None)


def operand_stats(t, spec, axis: int, key=None):
    """float32 [len(STATS)] for 2-D operand ``t`` quantized by ``spec`` along ``axis``.
    ``key``: the stochastic-rounding key, needed when ``spec.stochastic``.

    Every statistic is a full reduction of an elementwise expression (XLA fuses each with its
    producers); the probe computes 42 of these per layer, so they decide its run time."""
    if spec.fmt is None:
        raise ValueError("operand_stats: a BF16 operand is not quantized")
    t = transformed(t, spec, axis).astype(jnp.float32)
    b = _blocked(t, spec, axis, key)
    finite = jnp.isfinite(b.t)
    nonzero = finite & (b.t != 0)  # zero padding never counts
    kept = nonzero & jnp.isfinite(b.deq)  # not lost to a NaN block (MXFP8), where codes mean nothing
    fmax = F.max_of(F.FORMAT_SPECS[spec.fmt].element)
    used = jnp.isfinite(b.amax) & (b.amax > 0)
    # SQNR sums normalized by the largest finite block amax, so they cannot overflow.
    scale = jnp.max(jnp.where(used, b.amax, 0))
    scale = jnp.where(scale > 0, scale, 1)
    count = lambda mask: mask.astype(jnp.int32)  # noqa: E731
    n_nonzero, n_underflow, n_saturated, n_lost, signal, noise = _sums(
        count(nonzero), count(kept & b.zero), count(kept & (jnp.abs(b.stored) == fmax)),
        count(finite & ~jnp.isfinite(b.deq)),
        # Each side scaled before the difference: a difference of tiny values would be a
        # float32 subnormal, which CPU arithmetic flushes to zero.
        jnp.where(finite, jnp.square(b.t / scale), 0),
        jnp.where(finite & jnp.isfinite(b.deq), jnp.square(b.t / scale - b.deq / scale), 0))
    exact = noise == 0
    db = 10 * jnp.log10(signal / jnp.where(exact, 1, noise))
    sqnr = jnp.where(n_lost > 0, -jnp.inf, jnp.where(exact, jnp.inf, db))
    n_used, n_limit = _sums(count(used), count(used & b.at_limit))
    has_exp = used & ~jnp.isnan(b.exponent)
    exp_min = jnp.min(jnp.where(has_exp, b.exponent, jnp.inf))
    exp_max = jnp.max(jnp.where(has_exp, b.exponent, -jnp.inf))
    any_exp = jnp.isfinite(exp_max)
    # The tensor's amax as the largest block amax: the same bits as abs_max(t) (a max over
    # maxima; zero padding adds nothing), without another pass over the tensor.
    return jnp.stack([abs_max(b.amax), _fraction(n_underflow, n_nonzero), _fraction(n_saturated, n_nonzero),
                      sqnr, jnp.where(any_exp, exp_min, jnp.nan), jnp.where(any_exp, exp_max, jnp.nan),
                      _fraction(n_limit, n_used)]).astype(jnp.float32)


def _sums(*per_element):
    """The sums over all elements of same-shaped arrays (int32 or float32), each in two
    stages: over the last axis (a block's elements), then over the rest. XLA:CPU runs a
    last-axis reduction as one loop over the elementwise expression it sums; a sum over
    everything at once becomes a tree of reduce-windows over the expression written out at
    full size. The barrier keeps XLA from merging the two stages back into one. Measured on
    a 2048 x 384 NVFP4 operand (CPU): the statistics 2x faster than one [n, k] reduction of
    the stacked arrays, which was 4-6x slower than a row reduction; one variadic reduction
    computing every sum in one pass was slower than separate ones."""
    firsts = lax.optimization_barrier([jnp.sum(x, axis=-1) for x in per_element])
    return tuple(jnp.sum(f) for f in firsts)
