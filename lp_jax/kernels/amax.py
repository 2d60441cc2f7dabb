"""The tensor amax: one read, a partial max per tile, then a max over the partials.

Per-tensor FP8 and NVFP4's tensor scale need the amax of the whole tensor before any
element is cast. The partial maxima are exact (a max picks an element), so reducing them
in any order gives ``quantize``'s amax bit for bit, NaN included (jnp.max propagates it).
Each tile writes its partial max SMEM_LANES times (Mosaic GPU stores vectors of a multiple
of 128 elements, not a lone scalar); the copies change no max.
With ``rht`` it also returns the amax of the tensor after the 16-point Hadamard transform
along R (NVFP4's wgrad copy takes its own tensor scale there), from the same read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lp_jax.kernels.launch import SMEM_LANES, Block, tiled_kernel
from lp_jax.kernels.tiles import Tiling
from lp_jax.numerics.hadamard import hadamard
from lp_jax.numerics.quantize import abs_max


def tensor_amax(x3, t: Tiling, *, plain: bool = True, rht: bool = False, interpret=None):
    """x3: [A, R, C] padded to whole tiles. Returns the float32 amaxes asked for, as a tuple:
    (max |x|,) and/or (max |RHT_R(x)|,)."""
    def compute(_, x):
        x = x[0]
        out = [abs_max(x)] if plain else []
        if rht:
            out.append(abs_max(hadamard(x, axis=0, in_kernel=True)))
        return [jnp.broadcast_to(m, (1, 1, SMEM_LANES)) for m in out]

    n_out = int(plain) + int(rht)
    a_n, n_i, n_j = t.grid
    partial = jax.ShapeDtypeStruct((a_n, n_i, n_j * SMEM_LANES), jnp.float32)
    one = Block((1, 1, SMEM_LANES), lambda a, i, j: (a, i, j))
    parts = tiled_kernel(compute, [x3], [Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j))],
                         [partial] * n_out, [one] * n_out, t.grid, interpret)
    return tuple(jnp.max(p) for p in parts)
