"""Quantize-and-decode in one pass, for GEMM operands that are never stored.

An operand its GEMM consumes at once needs no packed low-precision bytes: each format's
``values`` computes its exact dequantized values straight from the high-precision tensor,
with the same rounding code as ``lp_jax.quantize``. Each returns (values, factor): float32
values of t with the blocked ``axis`` moved last (the layout the blocks are computed in,
and the contraction-last layout a GEMM reads), equal to the dequantized tensor divided by
the scalar ``factor`` (None when there is none), which the GEMM applies to its FP32 result.
The per-format functions live with their formats and are importable from here too.
"""
from __future__ import annotations

from lp_jax.numerics.fp8_block import fp8_block_values
from lp_jax.numerics.fp8_per_tensor import per_tensor_values
from lp_jax.numerics.mxfp8 import mxfp8_values
from lp_jax.numerics.nvfp4 import nvfp4_values, nvfp4_values_in_place
from lp_jax.numerics.quantize import check_quantize_args, format_named

__all__ = ["fp8_block_values", "mxfp8_values", "nvfp4_values", "nvfp4_values_in_place", "per_tensor_values",
           "quantized_values"]


def quantized_values(t, fmt, axis, *, block_2d=False, rounding="nearest", key=None, scale_rule="rceil",
                     block_scale_search=None, metric="mae"):
    if block_scale_search:  # a variant that only XLA's quantizer makes: its arguments checked as there
        check_quantize_args(t, fmt, axis, block_2d, rounding, key, "rceil", block_scale_search, metric)
    options = dict(block_2d=block_2d, rounding=rounding, key=key, scale_rule=scale_rule,
                   block_scale_search=block_scale_search, metric=metric)
    return format_named(fmt).values(t, axis, **options)
