"""FP8 block scaling (Transformer Engine's Float8BlockScaling, DeepSeek-V3's recipe): FP8
values in 1x128 blocks (or 128x128 tiles for weights) with FP32 power-of-two scales and no
tensor scale (docs/numerics.md). One scheme, two format objects: E4M3 ("fp8_block") and
E5M2 ("fp8_block_e5m2", the gradients of TE's fp8_format HYBRID)."""
from __future__ import annotations

import dataclasses
import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics.blocks import (
    abs_max,
    along_blocks,
    block_amax,
    from_blocks,
    from_tiles,
    per_element,
    to_blocks,
    to_tiles,
)
from lp_jax.numerics.division import div
from lp_jax.numerics.format import Format
from lp_jax.numerics.quantized_tensor import QuantizedTensor

FP8_BLOCK = 128  # elements per scale (or a tile's side)


def fp8_block_scales(amax, fmax=F.E4M3_MAX):
    """FP8 block scaling, per block: (scale, scale_inv), float32 powers of two.

    scale = fmax / amax (the element's largest value, 448 or 57344), FLT_MAX where that
    overflows, 1 where amax is 0, inf or NaN, then rounded down to a power of two by its
    exponent bits. The tests read amax's bits, not its value: a subnormal amax compares
    equal to 0 on CPU (denormals are zero there), and its quotient overflows either way.
    scale_inv is built from bits too: 2^-127, the reciprocal of the largest scale, is
    subnormal."""
    amax = amax.astype(jnp.float32)
    bits = F.f32_bits(amax)
    scale = div(jnp.float32(fmax), amax)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(F.FLT_MAX), scale)
    scale = jnp.where((bits == 0) | (bits >= 0x7F800000), jnp.float32(1), scale)
    e = (F.f32_bits(scale) >> 23) & 0xFF  # scale >= fmax / FLT_MAX: always normal
    inv_bits = jnp.where(e == 254, jnp.uint32(0x00400000), (254 - e) << 23)
    return (lax.bitcast_convert_type(e << 23, jnp.float32),
            lax.bitcast_convert_type(inv_bits.astype(jnp.uint32), jnp.float32))


def fp8_block_encode(x, scale, element=F.E4M3):
    """``element`` (E4M3 or E5M2) codes of x * scale (scale a power of two, broadcast to x):
    nearest even, saturating to the element's largest value, NaN to a NaN code. The product
    is exact; a subnormal x is scaled from its integer mantissa, since CPU flushes it as an
    operand."""
    x = x.astype(jnp.float32)
    bits = F.f32_bits(x)
    k = ((F.f32_bits(scale) >> 23) & 0xFF).astype(jnp.int32) - 127
    # x = m * 2^-149 for a subnormal; k - 149 >= -252 keeps mul_exp2's factors normal (below
    # that the product is far under the smallest FP8 subnormal, 2^-16, and rounds to zero).
    tiny = F.mul_exp2((bits & 0x7FFFFF).astype(jnp.float32), jnp.maximum(k - 149, -252))
    y = jnp.where(((bits >> 23) & 0xFF) == 0, jnp.copysign(tiny, x), x * scale)
    y = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), y)
    return F.cast_satfinite(y, element)


def _without_nan(x):
    """FP8 block scaling's amax ignores NaN elements (they still encode as NaN)."""
    return jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)


def quantize_fp8_block(xf, axis, block_2d=False, fmt: FP8Block | None = None) -> QuantizedTensor:
    """1x128 blocks along ``axis``, or 128x128 tiles over the last two axes, in ``fmt``'s
    element (FP8_BLOCK_FORMAT's E4M3 by default)."""
    fmt = fmt or FP8_BLOCK_FORMAT
    if block_2d:
        r, c = xf.shape[-2:]
        xt = to_tiles(xf, FP8_BLOCK)
        scale, inv = fp8_block_scales(abs_max(_without_nan(xt), axis=(-3, -1)), fmt.max)
        data = fp8_block_encode(xt, scale[..., :, None, :, None], fmt.element)
        return QuantizedTensor(from_tiles(data, r, c), inv, None, fmt.name, xf.ndim - 1, True)
    scale, inv = fp8_block_scales(block_amax(_without_nan(xf), axis, FP8_BLOCK), fmt.max)
    xb = to_blocks(xf, axis, FP8_BLOCK)
    data = from_blocks(fp8_block_encode(xb, along_blocks(scale, xb.shape), fmt.element), axis, xf.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(inv, -1, axis), None, fmt.name, axis)


def fp8_block_values(t, axis, block_2d=False, fmt: FP8Block | None = None):
    q = quantize_fp8_block(t, axis, block_2d, fmt)
    q = dataclasses.replace(q, data=lax.optimization_barrier(q.data))
    return jnp.moveaxis(_block_values(q), axis, -1), None


def _block_values(q: QuantizedTensor):
    return fp8_block_decode(q.data.astype(jnp.float32), per_element(q, FP8_BLOCK))


def fp8_block_decode(codes, scale_inv):
    """code x scale_inv (float32, broadcast): exact, a float32 subnormal value included (a
    tiny block's scale_inv is the subnormal 2^-127), on CPU too, which flushes subnormals.
    The plain product where lowered for CUDA, which keeps them."""
    return lax.platform_dependent(codes, scale_inv, default=_decode_on_bits, cuda=operator.mul)


def _decode_on_bits(codes, scale_inv):
    """code x 2^k, k the exponent of the power of two scale_inv: applied as two normal
    factors where the result is normal; a subnormal result, code x 2^(k + 149) units of
    2^-149, is an integer (an FP8 code's last bit is at least 2^-16, and k >= -127) below
    2^23, made into the result's bits."""
    bits = F.f32_bits(scale_inv)
    field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    k = jnp.where(field > 0, field - 127, 31 - lax.clz(bits & 0x7FFFFF).astype(jnp.int32) - 149)
    units = F.mul_exp2(jnp.abs(codes), jnp.minimum(k + 149, 254))
    sign = F.f32_bits(codes) & np.uint32(0x80000000)
    subnormal = lax.bitcast_convert_type(units.astype(jnp.uint32) | sign, jnp.float32)
    return jnp.where(units < 2.0**23, subnormal, F.mul_exp2(codes, k))


@dataclasses.dataclass(frozen=True)
class FP8Block(Format):
    scheme = "fp8_block"

    def quantize(self, xf, axis, *, block_2d=False, **_):
        return quantize_fp8_block(xf, axis, block_2d, self)

    def block_values(self, q):
        return _block_values(q)

    def values(self, t, axis, *, block_2d=False, **_):
        return fp8_block_values(t, axis, block_2d, self)


# Hopper runs it on its own WGMMA GEMM (lp_jax.kernels.fp8_block_gemm); cuDNN's block-scaled
# GEMM runs it as MXFP8 (its power-of-two scales are E8M0 codes; lp_jax.gemm.cudnn).
def _fp8_block(name, element):
    return FP8Block(name=name, label="FP8 block", color="tab:cyan", element=element, block=FP8_BLOCK,
                    scale=np.float32, tensor_scale=False, tiles=True, gemm="cudnn", hopper_gemm="wgmma")


FP8_BLOCK_FORMAT = _fp8_block("fp8_block", F.E4M3)
FP8_BLOCK_E5M2_FORMAT = _fp8_block("fp8_block_e5m2", F.E5M2)
