"""Quantization statistics of one GEMM operand, in JAX.

``operand_stats(t, spec, axis, key)`` quantizes the 2-D operand ``t`` exactly as the quantized
dot_general does (the RHT first where the spec says, the same quantizer, the same blocks along
``axis``, the contraction axis of the GEMM that consumes it) and returns float32 [len(STATS)]:
amax, underflow, saturation, sqnr_db, scale_exp_min, scale_exp_max (NaN when no block has a
finite non-zero amax) and scale_at_limit, each defined in docs/telemetry.md. Counts are exact
int32 sums, so the fractions are exact up to one float32 division.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.gemm.operands import transformed
from lp_jax.numerics import formats as F
from lp_jax.numerics import four_over_six
from lp_jax.numerics.quantize import (
    FP8_BLOCK,
    MX_BLOCK,
    NVFP4_BLOCK,
    abs_max,
    fp8_block_decode,
    fp8_block_encode,
    fp8_block_scales,
    mxfp8_block_factors,
    mxfp8_decode_factors,
    nvfp4_block_encoding,
    nvfp4_encode_values,
    nvfp4_tensor_scale,
    quantize_per_tensor,
    tensor_scale_fp8,
    to_blocks,
    to_blocks_in_place,
    to_tiles,
)
from lp_jax.numerics.registry import format_named

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
    exponent and whether the scale sits at its limit. ``block_axis``: the axis holding a
    block's elements (every block-wise sum reduces it)."""

    t: jax.Array
    stored: jax.Array
    zero: jax.Array  # where the GEMM multiplies a zero: element 0 (or NVFP4 block scale 0)
    deq: jax.Array
    amax: jax.Array
    exponent: jax.Array
    at_limit: jax.Array
    block_axis: int = -1


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Blocks of ``block`` along ``axis`` of a 2-D t, in t's own element order: t's last axis
    split into [n, block] (blocks last), or its first axis into [n, block, N] (the block's
    elements in the middle). The statistics are sums over all elements, which need no
    particular order, so blocks along the first axis are not moved last: that would be a
    transposed copy of the whole operand, which XLA:CPU writes slowly."""

    axis: int  # the reduced axis of the blocked array: -1 or -2

    @staticmethod
    def of(t, axis, block, blocks_last=False):
        """``blocks_last``: blocks along the first axis moved last all the same, for a
        computation that takes them there (4/6's choice)."""
        if blocks_last or axis % t.ndim == t.ndim - 1:
            return to_blocks(t, axis, block), _Layout(-1)
        return to_blocks_in_place(t, block), _Layout(-2)

    def expand(self, per_block):
        """[..., n, (N)] per-block values broadcast along the block."""
        return jnp.expand_dims(per_block, self.axis)


def _written_once(stored):
    """The encoded values materialized: the dequantized copy, the counts and the noise all
    read them; fused into each, XLA would redo the rounding (and an SR hash) in every one."""
    return lax.optimization_barrier(stored)


def _per_tensor(t, element, axis):
    # Blocks of 32 only to bound the per-block counts (_counts packs them in bytes); the
    # scale is the tensor's, and the zero padding changes neither its amax nor any count.
    xb, layout = _Layout.of(t, axis, MX_BLOCK)
    data, scale_inv = quantize_per_tensor(xb, element)
    stored = _written_once(data.astype(jnp.float32))
    amax = abs_max(xb)
    clamped = tensor_scale_fp8(amax, F.max_of(element)) == F.FLT_MAX
    # F.mul's exact product for a subnormal scale_inv costs integer work per element; a
    # normal one (the usual case) is a plain product: one branch runs, not both.
    subnormal = (F.f32_bits(scale_inv) >> 23) == 0
    deq = lax.cond(subnormal, F.mul, jnp.multiply, stored, scale_inv)
    return _Blocked(xb, stored, stored == 0, deq, amax[None],
                    _floor_log2(scale_inv)[None], clamped[None], layout.axis)


def _mxfp8(t, axis, scale_rule):
    xb, layout = _Layout.of(t, axis, MX_BLOCK)
    amax = abs_max(xb, axis=layout.axis)
    code, f1, f2 = lax.optimization_barrier(mxfp8_block_factors(amax, scale_rule))
    # mxfp8_blocks' cast, with the factors broadcast along this layout's block axis
    scaled = xb * layout.expand(f1) * layout.expand(f2)
    stored = _written_once(F.cast_satfinite(scaled, F.E4M3).astype(jnp.float32))
    k = code.astype(jnp.int32)
    # F.mul_exp2(stored, k - 127) with its two factors formed once per block, not per element
    nan, d1, d2 = (layout.expand(f) for f in mxfp8_decode_factors(code))
    deq = jnp.where(nan, jnp.float32(jnp.nan), stored * d1 * d2)
    at_limit = (k == E8M0_LIMIT_CODES[0]) | (k == E8M0_LIMIT_CODES[1])
    return _Blocked(xb, stored, stored == 0, deq, amax, (k - 127).astype(jnp.float32), at_limit,
                    layout.axis)


def _block_layout(t, axis, block, block_2d, blocks_last=False):
    """(blocked t, its amax axes, the block axis, per-block -> per-element broadcast): 1-D
    blocks along ``axis`` in t's own order (``_Layout``), or block x block tiles."""
    if block_2d:
        return to_tiles(t, block), (-3, -1), -1, lambda per_block: per_block[..., :, None, :, None]
    xb, layout = _Layout.of(t, axis, block, blocks_last)
    return xb, layout.axis, layout.axis, layout.expand


def _fp8_block(t, axis, block_2d, fmt):
    xb, amax_axes, block_axis, expand = _block_layout(t, axis, FP8_BLOCK, block_2d)
    # The scale ignores NaN elements (as the quantizer does); the statistics' block amax
    # keeps them, so a block holding a NaN counts as unused, as in the other formats.
    amax = abs_max(xb, axis=amax_axes)
    scale, scale_inv = fp8_block_scales(abs_max(jnp.where(jnp.isnan(xb), 0, xb), axis=amax_axes), fmt.max)
    stored = _written_once(fp8_block_encode(xb, expand(scale), fmt.element).astype(jnp.float32))
    deq = fp8_block_decode(stored, expand(scale_inv))
    # At its limit: the scale clamped to the largest power of two (fmax / amax overflowed).
    at_limit = _floor_log2(scale) == 127
    return _Blocked(xb, stored, stored == 0, deq, amax, _floor_log2(scale_inv), at_limit, block_axis)


def _nvfp4(t, axis, block_2d, rounding, key, search=None, metric="mae"):
    # 4/6's choice takes 1-D blocks laid out last ([..., n, 16]), whatever the axis
    xb, amax_axes, block_axis, expand = _block_layout(t, axis, NVFP4_BLOCK, block_2d,
                                                      blocks_last=bool(search))
    amax = abs_max(xb, axis=amax_axes)
    amax_t = abs_max(amax)  # the tensor's amax, from its blocks' (the same bits)
    if search:  # 4/6 block scales, chosen as the quantizer chooses them
        s_b, enc = four_over_six.choose_scales(xb, amax, amax_t, block_2d, metric)
    else:
        s_enc = nvfp4_tensor_scale(amax_t)
        s_b, enc = nvfp4_block_encoding(amax, s_enc)
    stored = _written_once(nvfp4_encode_values(xb, expand(enc), rounding, key))
    s_b = s_b.astype(jnp.float32)
    block_values = stored * expand(s_b)  # q * s_b, exact: both factors are at least 2^-10
    deq = (stored * expand(four_over_six.dequantize_factors(s_b, amax_t)) if search
           else F.mul(block_values, F.recip(s_enc)))
    exponent = jnp.where(s_b > 0, _floor_log2(jnp.where(s_b > 0, s_b, 1)), jnp.nan)
    return _Blocked(xb, stored, block_values == 0, deq, amax, exponent, s_b < E4M3_MIN_NORMAL, block_axis)


def _nvfp4_operand(t, spec, axis, key):
    rounding = "stochastic" if spec.stochastic else "nearest"
    if spec.stochastic and key is None:
        raise ValueError("operand_stats: a stochastically rounded operand needs key=")
    return _nvfp4(t, axis, spec.block_2d, rounding, key if spec.stochastic else None,
                  spec.block_scale_search, spec.metric)


# Each scheme's statistics, by the format object's ``scheme``: (t, OperandSpec, axis, key) -> _Blocked.
_BLOCKED = {
    "per_tensor": lambda t, spec, axis, key: _per_tensor(t, format_named(spec.fmt).element, axis),
    "mxfp8": lambda t, spec, axis, key: _mxfp8(t, axis, spec.scale_rule),
    "fp8_block": lambda t, spec, axis, key: _fp8_block(t, axis, spec.block_2d, format_named(spec.fmt)),
    "nvfp4": _nvfp4_operand,
}


def _blocked(t, spec, axis, key):
    return _BLOCKED[format_named(spec.fmt).scheme](t, spec, axis, key)


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
    fmax = format_named(spec.fmt).max
    used = jnp.isfinite(b.amax) & (b.amax > 0)
    # SQNR sums normalized by the power of two at or below the largest finite block amax, so
    # they cannot overflow: two exact multiplies per element, not a (slow) division.
    largest = jnp.max(jnp.where(used, b.amax, 0))
    n1, n2 = F.exp2_factors(-jnp.where(largest > 0, _floor_log2(largest), 0).astype(jnp.int32))
    norm = lambda v: v * n1 * n2  # noqa: E731
    n_nonzero, n_underflow, n_saturated, n_lost = _counts(
        b.block_axis, nonzero, kept & b.zero, kept & (jnp.abs(b.stored) == fmax),
        finite & ~jnp.isfinite(b.deq))
    signal, noise = _sums(
        b.block_axis,
        # Each side scaled before the difference: a difference of tiny values would be a
        # float32 subnormal, which CPU arithmetic flushes to zero.
        jnp.where(finite, jnp.square(norm(b.t)), 0),
        jnp.where(finite & jnp.isfinite(b.deq), jnp.square(norm(b.t) - norm(b.deq)), 0))
    exact = noise == 0
    db = 10 * jnp.log10(signal / jnp.where(exact, 1, noise))
    sqnr = jnp.where(n_lost > 0, -jnp.inf, jnp.where(exact, jnp.inf, db))
    # per block: 16-32x fewer values than elements, one plain sum each
    n_used, n_limit = jnp.sum(used, dtype=jnp.int32), jnp.sum(used & b.at_limit, dtype=jnp.int32)
    has_exp = used & ~jnp.isnan(b.exponent)
    exp_min = jnp.min(jnp.where(has_exp, b.exponent, jnp.inf))
    exp_max = jnp.max(jnp.where(has_exp, b.exponent, -jnp.inf))
    any_exp = jnp.isfinite(exp_max)
    # The tensor's amax as the largest block amax: the same bits as abs_max(t) (a max over
    # maxima; zero padding adds nothing), without another pass over the tensor.
    return jnp.stack([abs_max(b.amax), _fraction(n_underflow, n_nonzero), _fraction(n_saturated, n_nonzero),
                      sqnr, jnp.where(any_exp, exp_min, jnp.nan), jnp.where(any_exp, exp_max, jnp.nan),
                      _fraction(n_limit, n_used)]).astype(jnp.float32)


def _sums(axis, *per_element):
    """The sums over all elements of same-shaped float32 arrays, each in two stages: over
    ``axis`` (a block's elements), then over the rest. XLA:CPU runs a block-wise reduction
    as one loop over the elementwise expression it sums; a sum over everything at once
    becomes a tree of reduce-windows over the expression written out at full size. The
    barrier keeps XLA from merging the two stages back into one (docs/telemetry.md, "The
    probe's cost", has the measurements)."""
    firsts = lax.optimization_barrier([jnp.sum(x, axis=axis) for x in per_element])
    return tuple(jnp.sum(f) for f in firsts)


_COUNT_BITS = 8  # a block reduces at most 128 elements (FP8 block; MXFP8 32, NVFP4 16): counts fit a byte


def _counts(axis, *masks):
    """The number of True elements of up to four same-shaped boolean arrays, ``axis`` (a
    block's elements) at most 255 long: each mask in its own byte of one int32, so one pass
    over the elements counts all four per block; the per-block bytes are then unpacked
    (16-32x fewer values) and summed exactly in int32."""
    if len(masks) > 4 or masks[0].shape[axis] >= 1 << _COUNT_BITS:
        raise ValueError(f"_counts: {len(masks)} masks with {masks[0].shape[axis]} elements per block")
    packed = sum(m.astype(jnp.int32) << (_COUNT_BITS * i) for i, m in enumerate(masks))
    per_block = lax.optimization_barrier(jnp.sum(packed, axis=axis))
    return tuple(jnp.sum((per_block >> (_COUNT_BITS * i)) & 0xFF) for i in range(len(masks)))
