"""FP8 per-tensor current scaling (E4M3, E5M2): after the amax, one pass that scales and
casts each tile and writes the row-major copy and, if asked, the transposed copy.

The scale (fmax / amax, with quantize's rules for zero, non-finite and overflowing amax) is
a scalar computed by the same function as the XLA path's before the kernel; the kernel
reads it from SMEM as a scalar, multiplies in float32 and casts (Mosaic GPU lowers this
for CUDA; it does not lower the scalar rules' ``is_finite``, nor a scalar taken out of a
loaded vector).
"""
from __future__ import annotations

import jax

from lp_jax.kernels.launch import WHOLE, Block, tiled_kernel
from lp_jax.kernels.tiles import Tiling
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import scale_cast_fp8, tensor_scale_fp8


def fp8_cast(x3, amax, dtype, t: Tiling, *, rows=True, transposed=False, interpret=None):
    """x3 [A, R, C] padded to whole tiles, amax float32: a vector whose first element is the
    tensor amax (``tensor_amax``'s lane vector, or (1,)). Returns the FP8 data [A, R, C]
    (if rows) and its transpose [A, C, R] (if transposed), both padded."""
    scale = tensor_scale_fp8(amax, F.max_of(dtype))

    def compute(_, x, scale):
        data = scale_cast_fp8(x[0], scale[0], dtype)  # quantize's own rounding
        return ([data[None]] if rows else []) + ([data.T[None]] if transposed else [])

    a, rp, cp = t.padded
    outs, blocks = [], []
    if rows:
        outs.append(jax.ShapeDtypeStruct((a, rp, cp), dtype))
        blocks.append(Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j)))
    if transposed:
        outs.append(jax.ShapeDtypeStruct((a, cp, rp), dtype))
        blocks.append(Block((1, t.tc, t.tr), lambda a, i, j: (a, j, i)))
    return tiled_kernel(compute, [x3, scale], [Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j)), WHOLE],
                        outs, blocks, t.grid, interpret)
