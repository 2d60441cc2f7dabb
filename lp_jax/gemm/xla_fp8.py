"""The "xla_fp8" backend: per-tensor FP8 GEMMs as XLA's GEMM rewriter wants them.

The FP8 bytes of both operands go into ``lax.dot_general`` as FP8 arrays with an FP32
result, times the product of the two scales (sa * sb): the pattern XLA's GPU GEMM rewriter
turns into one ``__cublas$lt$matmul$f8`` call. One product rather than the reference's two
scalings, because a single scalar multiply is what the rewriter folds into the GEMM (at most
one FP32 rounding apart). Precision HIGHEST turns off cuBLASLt's FP8 fast accumulation, so
the GEMM sums in FP32 like the reference. On CPU XLA upcasts the FP8 operands: the products
are exact and only the summation order differs from the reference (docs/backends.md).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from lp_jax.numerics.quantize import QuantizedTensor, format_named


def _fp8(p):
    if not (isinstance(p, QuantizedTensor) and format_named(p.fmt).per_tensor):
        raise ValueError(f"the xla_fp8 backend multiplies per-tensor FP8 operands, got {type(p).__name__}"
                         f"{'' if not isinstance(p, QuantizedTensor) else ' ' + p.fmt}")
    # The barrier keeps a GPU that cannot run this FP8 GEMM (XLA then upcasts the operands)
    # from folding the f32 -> fp8 -> f32 round trip away as excess precision.
    return lax.optimization_barrier(p.data), p.scale


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """FP8 a x FP8 b over ``contracting``, FP32 accumulation, times both scales, in out_dtype."""
    (av, sa), (bv, sb) = _fp8(a), _fp8(b)
    out = lax.dot_general(av, bv, (contracting, ((), ())), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(out_dtype)
