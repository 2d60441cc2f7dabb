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

from lp_jax.gemm.cudnn import block_operands
from lp_jax.gemm.operands import scale_result


def _whole_blocks(data, block):
    """K zero-padded to whole blocks (the call needs K = blocks x block size): the last
    block's scale is there already, and the zeros add nothing."""
    pad = -data.shape[1] % block
    return jnp.pad(data, ((0, 0), (0, pad))) if pad else data


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """a x b over ``contracting`` in one scaled dot (FP32 accumulation), in out_dtype."""
    ad, as_, fa, bd, bs, fb, block = block_operands(a, b, contracting)
    ad, bd = _whole_blocks(ad, block), _whole_blocks(bd, block)
    # Where XLA expands the call it converts the bytes back up; the barrier keeps that
    # convert from meeting our quantizer's and being folded away as excess precision.
    ad, bd, as_, bs = lax.optimization_barrier((ad, bd, as_, bs))
    out = lax.scaled_dot(ad, bd, lhs_scale=as_, rhs_scale=bs, dimension_numbers=(((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return scale_result(out, fa, fb).astype(out_dtype)
