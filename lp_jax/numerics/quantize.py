"""The quantizers' definition in XLA: ``quantize_xla``, ``dequantize`` and the check of
``lp.quantize``'s arguments, each asking the format's object (``lp_jax.numerics.registry``)
for what differs per format (docs/numerics.md).

Each format's scale rules and block functions live with it (``fp8_per_tensor``,
``fp8_block``, ``mxfp8``, ``nvfp4``; the shared layout in ``blocks``), and every other
quantizer (the GEMM operands, the Pallas kernels) calls the same functions: one definition
of every rounding. They are importable from here too.
"""
from __future__ import annotations

import jax.numpy as jnp

from lp_jax.numerics import formats as F
from lp_jax.numerics import four_over_six
from lp_jax.numerics.blocks import (
    abs_max,
    along_blocks,
    block_amax,
    from_blocks,
    from_tiles,
    to_blocks,
    to_blocks_in_place,
    to_tiles,
    unblocked,
)
from lp_jax.numerics.fp8_block import (
    FP8_BLOCK,
    fp8_block_decode,
    fp8_block_encode,
    fp8_block_scales,
    quantize_fp8_block,
)
from lp_jax.numerics.fp8_per_tensor import TENSOR_AMAX, quantize_per_tensor, scale_cast_fp8, tensor_scale_fp8
from lp_jax.numerics.mxfp8 import MX_BLOCK, mxfp8_block_factors, mxfp8_blocks, mxfp8_decode_factors
from lp_jax.numerics.nvfp4 import (
    INV_E2M1_MAX,
    NVFP4_BLOCK,
    NVFP4_TENSOR_SCALE_NUM,
    nvfp4_block_encoding,
    nvfp4_block_scales,
    nvfp4_blocks,
    nvfp4_encode,
    nvfp4_encode_codes,
    nvfp4_encode_values,
    nvfp4_tensor_scale,
    nvfp4_tiles,
)
from lp_jax.numerics.quantized_tensor import QuantizedTensor
from lp_jax.numerics.registry import NAMES, REGISTRY, format_named, names_where

__all__ = [
    "BLOCK_2D_FORMATS", "BLOCK_SCALE_SEARCHES", "FORMATS", "FP8_BLOCK", "INV_E2M1_MAX", "MX_BLOCK",
    "NVFP4_BLOCK", "NVFP4_TENSOR_SCALE_NUM", "QuantizedTensor", "ROUNDINGS", "SCALE_RULES", "TENSOR_AMAX",
    "abs_max", "along_blocks", "as_quantizer_input", "block_amax", "block_values", "check_quantize_args",
    "dequantize", "format_named", "fp8_block_decode", "fp8_block_encode", "fp8_block_scales", "from_blocks",
    "from_tiles", "mxfp8_block_factors", "mxfp8_blocks", "mxfp8_decode_factors", "nvfp4_block_encoding",
    "nvfp4_block_scales", "nvfp4_blocks", "nvfp4_encode", "nvfp4_encode_codes", "nvfp4_encode_values",
    "nvfp4_tensor_scale", "nvfp4_tiles", "quantize_fp8_block", "quantize_per_tensor", "quantize_xla",
    "scale_cast_fp8", "tensor_scale_fp8", "to_blocks", "to_blocks_in_place", "to_tiles", "unblocked",
]

FORMATS = NAMES
ROUNDINGS = ("nearest", "stochastic")
BLOCK_SCALE_SEARCHES = (None, *(option for f in REGISTRY.values() for option in f.block_scale_searches))
SCALE_RULES = ("rceil", "floor")
BLOCK_2D_FORMATS = names_where(lambda f: f.tiles)


def _defined_for(has) -> str:
    """'fmt='nvfp4'' or 'fmt in (...)': the formats an option is defined for, for a message."""
    names = names_where(has)
    return f"fmt={names[0]!r}" if len(names) == 1 else f"fmt in {names}"


def check_quantize_args(x, fmt, axis, block_2d, rounding, key, scale_rule, block_scale_search=None,
                        metric="mae"):
    """One line (ValueError) for arguments ``lp_jax.quantize`` does not accept."""
    if block_scale_search not in BLOCK_SCALE_SEARCHES:
        raise ValueError(f"block_scale_search={block_scale_search!r} is not valid; expected one of "
                         f"{BLOCK_SCALE_SEARCHES}")
    known = REGISTRY.get(fmt) if isinstance(fmt, str) else None
    if block_scale_search and (known is None or block_scale_search not in known.block_scale_searches):
        where = _defined_for(lambda f: block_scale_search in f.block_scale_searches)
        raise ValueError(f"block_scale_search={block_scale_search!r} is only defined for {where}, "
                         f"got fmt={fmt!r}")
    if metric not in four_over_six.METRICS:
        raise ValueError(f"metric={metric!r} is not valid; expected one of {four_over_six.METRICS}")
    spec = format_named(fmt)
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array (bfloat16 or float32), got dtype {dtype}")
    ndim = jnp.ndim(x)
    if ndim == 0 and spec.block:
        raise ValueError(f"x must have at least one axis for block format {fmt!r}")
    if ndim and not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {ndim}")
    if block_2d and not spec.tiles:
        raise ValueError(f"block_2d=True is only defined for fmt in {BLOCK_2D_FORMATS}, got fmt={fmt!r}")
    if block_2d and ndim < 2:
        b = spec.block
        raise ValueError(f"block_2d=True needs at least 2 axes ({b}x{b} tiles over the last two), "
                         f"got rank {ndim}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not valid; expected one of {ROUNDINGS}")
    if rounding == "stochastic" and not spec.stochastic:
        raise ValueError(f"rounding='stochastic' is only defined for {_defined_for(lambda f: f.stochastic)}, "
                         f"got fmt={fmt!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs key= (a jax.random key)")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule={scale_rule!r} is not valid; expected one of {SCALE_RULES}")


def quantize_xla(x, fmt, axis=-1, *, block_2d=False, rounding="nearest", key=None,
                 scale_rule="rceil", tensor_amax=None, block_scale_search=None,
                 metric="mae") -> QuantizedTensor:
    """``lp_jax.quantize(x, fmt, axis, ..., impl="xla")``: the arguments are checked, then
    quantized by the format's block functions.

    tensor_amax: max |x| of the whole tensor when x is one shard of it (reduced across the
    shards by the caller), for the per-tensor scales of fp8_e4m3/fp8_e5m2 and nvfp4.
    """
    check_quantize_args(x, fmt, axis, block_2d, rounding, key, scale_rule, block_scale_search, metric)
    x = jnp.asarray(x)
    ndim = x.ndim
    axis = axis % ndim if ndim else 0
    # Widened through its bits (formats.exact_f32): on a GPU, XLA would otherwise quantize
    # the float32 value a fused producer had before rounding it to x's bf16.
    xf = F.exact_f32(x)
    return format_named(fmt).quantize(xf, axis, block_2d=block_2d, rounding=rounding, key=key,
                                      scale_rule=scale_rule, tensor_amax=tensor_amax,
                                      block_scale_search=block_scale_search, metric=metric)


def as_quantizer_input(x):
    """x as bf16 or f32, what the quantizers take (the Pallas kernels read bf16 as it is;
    ``quantize_xla`` widens it with ``formats.exact_f32``)."""
    return x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32)


def block_values(q: QuantizedTensor):
    """float32 values of q without the tensor scale: q * 2^(e-127) for MXFP8 (exact), q * s_b
    for NVFP4 (exact in bf16), code x scale_inv for FP8 block scaling."""
    return format_named(q.fmt).block_values(q)


def dequantize(q: QuantizedTensor):
    """float32 values of ``q``, the shape of the original tensor."""
    return format_named(q.fmt).dequantize(q)
