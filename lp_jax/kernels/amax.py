"""The tensor amax: one read, a partial max per tile, then a max over the partials.

The partial maxima are exact (a max picks an element), so reducing them in any order gives
``quantize``'s amax bit for bit, NaN included. Each tile writes its partial max SMEM_LANES
times (Mosaic GPU stores vectors of a multiple of 128 elements, not a lone scalar); the
copies change no max, and they let the amax stay a vector: the max over the tiles of each
lane is the tensor amax in every lane, which the kernels that use it read as their WHOLE
input as it is and compute their tensor scale from (no scalar to pad to SMEM_LANES, no
reduction of a reduction, no scale fusion between the amax and the quantizer). With
``rht`` it also returns, from the same read, the amax after the 16-point Hadamard transform
along R (NVFP4's wgrad copy takes its own tensor scale there).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.kernels.launch import SMEM_LANES, Block, tiled_kernel
from lp_jax.kernels.pallas_nvfp4 import rht_amax_bits
from lp_jax.kernels.strided import Tile, is_interpreted
from lp_jax.kernels.tiles import Tiling
from lp_jax.numerics.manual_axes import tensor_amax as manual_tensor_amax
from lp_jax.numerics.quantize import abs_max


def tensor_amax(x3, t: Tiling, *, plain: bool = True, rht: bool = False, interpret=None):
    """x3: [A, R, C] padded to whole tiles. Returns the float32 amaxes asked for, as a tuple:
    (max |x|,) and/or (max |RHT_R(x)|,), each a [SMEM_LANES] vector of that amax (``lane``
    takes the scalar). With ``rht``, the tiles are ``nvfp4_tiling``'s."""
    def compute(_, x_s, *out_s):
        out = [abs_max(x_s.at[0][...], axis=(0, 1))] if plain else []  # this tile's
        if rht:
            bits = rht_amax_bits(Tile(x_s.at[0], is_interpreted(interpret)))
            out.append(lax.bitcast_convert_type(jnp.max(bits), jnp.float32))
        for o, m in zip(out_s, out):
            o[...] = jnp.broadcast_to(m, (1, 1, SMEM_LANES))

    n_out = int(plain) + int(rht)
    a_n, n_i, n_j = t.grid
    partial = jax.ShapeDtypeStruct((a_n, n_i, n_j * SMEM_LANES), jnp.float32)
    one = Block((1, 1, SMEM_LANES), lambda a, i, j: (a, i, j))
    parts = tiled_kernel(compute, [x3], [Block((1, t.tr, t.tc), lambda a, i, j: (a, i, j))],
                         [partial] * n_out, [one] * n_out, t.grid, interpret, by_ref=True)
    # Inside the trainer's shard_map the tensor is every device's piece, as for XLA's amax.
    return tuple(manual_tensor_amax(jnp.max(p.reshape(-1, SMEM_LANES), axis=0)) for p in parts)


def lane(v):
    """The scalar of a lane vector (``tensor_amax``'s, or a tensor scale computed from it)."""
    return v[0]
