"""The "xla_scaled_dot" backend: MXFP8, NVFP4 and FP8 block GEMMs as XLA's ``scaled-dot``.

The bytes and block scales of both operands go into ``lax.scaled_dot`` (the composite
``xla.scaled_dot``), contraction last, with an FP32 result, then the operands' tensor
factors and the cast, as the reference applies them. Compiled for a GPU, XLA makes the call,
with the factor multiplies and the cast after it, one Triton GEMM fusion: the scales are read
in their logical layout (no swizzle kernels), a stacked operand's slice is read in place and
the result is written once, in the output dtype. That is what the "cudnn" backend cannot
have: XLA keeps cuDNN's call apart, swizzles both scale operands before it in kernels of
their own and writes its FP32 result for the next kernel to scale and cast.

How fast XLA's Triton code for the fusion is has not been measured (a deviceless compile
shows the kernels, not their speed): Blackwell's block-scaled MMA, or the dequantized
values through a BF16 one, which the compile does not show. ``python -m lp_jax.plan``
estimates the fusion at the format's peak like any block-scaled GEMM, an assumption
bench/gpu_check.sh checks when a GPU is lent (docs/backends.md). On CPU (and where XLA
expands the call) the composite dequantizes into BF16, exactly, and runs a BF16 dot with
FP32 accumulation: the reference's GEMM.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from lp_jax.gemm.cudnn import BLOCK_OF, as_mx_scales, block_operand
from lp_jax.gemm.operands import apply_factors


def _whole_blocks(data, scales, block):
    """K zero-padded to whole blocks (the call needs K = blocks x block size): the last
    block's scale is there already, and the zeros add nothing."""
    k = data.shape[1]
    pad = -k % block
    if not pad:
        return data, scales
    return jnp.pad(data, ((0, 0), (0, pad))), scales


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """a x b over ``contracting`` in one scaled dot (FP32 accumulation), in out_dtype."""
    (ca,), (cb,) = contracting
    ad, as_, fa = block_operand(a, ca)
    bd, bs, fb = block_operand(b, cb)
    if as_.dtype == jnp.float32:  # FP8 block scaling, both operands: as MXFP8 (docs/backends.md)
        as_, bs = as_mx_scales(as_, ad.shape[1]), as_mx_scales(bs, bd.shape[1])
    block = BLOCK_OF[jnp.dtype(ad.dtype)]
    ad, as_ = _whole_blocks(ad, as_, block)
    bd, bs = _whole_blocks(bd, bs, block)
    # Where XLA expands the call it converts the bytes back up; the barrier keeps that
    # convert from meeting our quantizer's and being folded away as excess precision.
    ad, bd, as_, bs = lax.optimization_barrier((ad, bd, as_, bs))
    out = lax.scaled_dot(ad, bd, lhs_scale=as_, rhs_scale=bs, dimension_numbers=(((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return apply_factors(out, fa, fb).astype(out_dtype)
