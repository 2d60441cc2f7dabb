"""FP8 per-tensor current scaling (E4M3, E5M2): after the amax, one pass that scales and
casts each tile and writes the row-major copy and, if asked, the transposed copy."""
from __future__ import annotations

import jax

from lp_jax.kernels.launch import WHOLE, Block, tiled_kernel
from lp_jax.kernels.tiles import Tiling
from lp_jax.numerics.quantize import quantize_per_tensor


def fp8_cast(x3, amax, dtype, t: Tiling, *, rows=True, transposed=False, interpret=None):
    """x3 [A, R, C] padded to whole tiles, amax float32 (1,). Returns the FP8 data [A, R, C]
    (if rows) and its transpose [A, C, R] (if transposed), both padded."""
    def compute(_, x, amax):
        data = quantize_per_tensor(x[0], dtype, amax[0])[0]  # quantize's own rounding
        return ([data[None]] if rows else []) + ([data.T[None]] if transposed else [])

    a, rp, cp = t.padded
    outs, blocks = [], []
    if rows:
        outs.append(jax.ShapeDtypeStruct((a, rp, cp), dtype))
        blocks.append(Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j)))
    if transposed:
        outs.append(jax.ShapeDtypeStruct((a, cp, rp), dtype))
        blocks.append(Block((1, t.tc, t.tr), lambda a, i, j: (a, j, i)))
    return tiled_kernel(compute, [x3, amax], [Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j)), WHOLE],
                        outs, blocks, t.grid, interpret)
