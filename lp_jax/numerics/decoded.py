"""Quantize-and-decode in one pass, for GEMM operands that are never stored.

An operand its GEMM consumes at once needs no packed low-precision bytes: these functions
compute its exact dequantized values straight from the high-precision tensor, with the same
rounding code as ``lp_jax.quantize``. Each returns (values, factor): float32 values of t
with the blocked ``axis`` moved last (the layout the blocks are computed in, and the
contraction-last layout a GEMM reads), equal to the dequantized tensor divided by the
scalar ``factor`` (None when there is none), which the GEMM applies to its FP32 result.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import (
    MX_BLOCK,
    NVFP4_BLOCK,
    abs_max,
    block_amax,
    block_values,
    from_tiles,
    mxfp8_blocks,
    mxfp8_decode_factors,
    nvfp4_block_encoding,
    nvfp4_encode_values,
    nvfp4_tensor_scale,
    quantize_fp8_block,
    quantize_per_tensor,
    quantize_xla,
    to_blocks,
    to_blocks_in_place,
    to_tiles,
    unblocked,
)


def per_tensor_values(t, dtype, axis=-1):
    data, scale_inv = quantize_per_tensor(t, dtype)
    # The barrier keeps XLA on GPU from folding f32 -> fp8 -> f32 away as excess precision.
    return jnp.moveaxis(lax.optimization_barrier(data).astype(jnp.float32), axis, -1), scale_inv


def mxfp8_values(t, axis, scale_rule="rceil"):
    # t stays in its own dtype (bf16): the amax is exact in it, and the upcast happens inside
    # the fused quantization pass instead of in a materialized float32 copy.
    data, code = mxfp8_blocks(to_blocks(t, axis, MX_BLOCK), scale_rule, block_amax(t, axis, MX_BLOCK))
    data = lax.optimization_barrier(data).astype(jnp.float32)
    nan, f1, f2 = (a[..., None] for a in mxfp8_decode_factors(code))
    values = jnp.where(nan, jnp.float32(jnp.nan), data * f1 * f2)  # = F.mul_exp2(data, code - 127)
    return unblocked(values, t.shape[axis]), None


def fp8_block_values(t, axis, block_2d=False):
    q = quantize_fp8_block(t, axis, block_2d)
    q = dataclasses.replace(q, data=lax.optimization_barrier(q.data))
    return jnp.moveaxis(block_values(q), axis, -1), None


def nvfp4_values(t, axis, block_2d=False, rounding="nearest", key=None):
    s_enc = nvfp4_tensor_scale(abs_max(t))
    if block_2d:
        xt = to_tiles(t)
        s_b, enc = nvfp4_block_encoding(abs_max(xt, axis=(-3, -1)), s_enc)
        q = nvfp4_encode_values(xt, enc[..., :, None, :, None], rounding, key)
        values = from_tiles(q * s_b.astype(jnp.float32)[..., :, None, :, None], *t.shape[-2:])
        values = jnp.moveaxis(values, axis, -1)
    else:
        xb = to_blocks(t, axis, NVFP4_BLOCK)
        s_b, enc = nvfp4_block_encoding(block_amax(t, axis, NVFP4_BLOCK), s_enc)
        q = nvfp4_encode_values(xb, enc[..., None], rounding, key)
        values = unblocked(q * s_b.astype(jnp.float32)[..., None], t.shape[axis])
    return values, F.recip(s_enc)


def nvfp4_values_in_place(t, rounding="nearest", key=None):
    """``nvfp4_values(t, 0, ...)`` for 2-D t, with 1-D blocks along axis 0, laid out as t is
    (blocks down the columns) instead of with that axis moved last: the same values,
    transposed, without the transposed pass over t, for a GEMM that reads its operand
    contracting the first axis. Stochastic rounding draws each element's bits by its place
    in the moved layout, as ``nvfp4_values`` does, so the rounding is the same bit for bit."""
    m, n = t.shape
    s_enc = nvfp4_tensor_scale(abs_max(t))
    xb = to_blocks_in_place(t, NVFP4_BLOCK)
    mp = xb.shape[0] * NVFP4_BLOCK
    s_b, enc = nvfp4_block_encoding(abs_max(xb, axis=1), s_enc)

    def noise(shape):  # shape [blocks, 16, n]: element (b, i, c) is (c, b, i) of the moved layout
        at = lambda d: lax.broadcasted_iota(jnp.uint32, shape, d)  # noqa: E731
        return F.uniform_from_index(F.sr_seeds(key), at(2) * jnp.uint32(mp) + at(0) * jnp.uint32(NVFP4_BLOCK) + at(1))

    q = nvfp4_encode_values(xb, enc[:, None, :], rounding, noise if rounding == "stochastic" else None)
    values = (q * s_b.astype(jnp.float32)[:, None, :]).reshape(mp, n)[:m]
    return values, F.recip(s_enc)


def quantized_values(t, fmt, axis, *, block_2d=False, rounding="nearest", key=None, scale_rule="rceil",
                     block_scale_search=None, metric="mae"):
    if block_scale_search:  # NVFP4 4/6: its values over the tensor factor the GEMM applies
        q = quantize_xla(t, fmt, axis, block_2d=block_2d, rounding=rounding, key=key,
                         block_scale_search=block_scale_search, metric=metric)
        q = dataclasses.replace(q, data=lax.optimization_barrier(q.data))
        return jnp.moveaxis(block_values(q), axis, -1), q.global_scale
    if fmt in F.PER_TENSOR_FORMATS:
        return per_tensor_values(t, F.FORMAT_SPECS[fmt].element, axis)
    if fmt == "fp8_block":
        return fp8_block_values(t, axis, block_2d)
    if fmt == "mxfp8":
        return mxfp8_values(t, axis, scale_rule)
    return nvfp4_values(t, axis, block_2d, rounding, key)
