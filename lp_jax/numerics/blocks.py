"""What every format's quantizer shares: the NaN-propagating amax and the block and tile
layouts.

The block functions of each format (``fp8_per_tensor``, ``fp8_block``, ``mxfp8``,
``nvfp4``) work on arrays laid out as ``[..., n_blocks, block]`` (or 16x16 / 128x128
tiles); these helpers move the blocked axis last, pad and split it, and put the blocks
back, and every quantizer (XLA's, the GEMM operands', the Pallas kernels') uses them.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from lp_jax.numerics.manual_axes import tensor_amax as manual_tensor_amax
from lp_jax.numerics.quantized_tensor import QuantizedTensor
from lp_jax.numerics.sharded_reshape import merge_axes, split_axis


def abs_max(x, axis=None, keepdims=False):
    """Plain NaN-propagating max |x| (a NaN anywhere makes the amax NaN), as float32.

    Taken in x's own dtype (a max picks an element, so it is exact), which spares a
    materialized float32 copy of a bf16 tensor. The max is over the bits of |x| as unsigned
    integers, which order non-negative floats as their values and every NaN above inf: XLA:CPU's
    float max reduction can drop a NaN (docs/backends.md).
    """
    a = jnp.abs(x)
    uint = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    m = jnp.max(lax.bitcast_convert_type(a, uint), axis=axis, keepdims=keepdims)
    amax = lax.bitcast_convert_type(m, a.dtype).astype(jnp.float32)
    # A whole-tensor amax inside the trainer's shard_map covers every device's piece.
    return manual_tensor_amax(amax) if axis is None else amax


def along_blocks(v, shape):
    """v [..., n] broadcast along the block axis to ``shape`` [..., n, block] in one step (a
    Pallas kernel's Mosaic GPU lowering has no layout for the [..., n, 1] intermediate)."""
    return lax.broadcast_in_dim(v, shape, tuple(range(v.ndim)))


def to_blocks(x, axis, block):
    """Moves ``axis`` last, zero-pads it to a multiple of ``block``, splits it into blocks."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return split_axis(x, -1, ((n + pad) // block, block))


def to_blocks_in_place(x, block):
    """Zero-pads x's first axis to a multiple of ``block`` and splits it into [n, block, ...]:
    blocks along the first axis in x's own element order (``to_blocks(x, 0, block)`` holds
    the same blocks, moved last, at the cost of a transposed copy)."""
    pad = -x.shape[0] % block
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return split_axis(x, 0, (x.shape[0] // block, block))


def block_amax(x, axis, block):
    """The per-block max |x| of ``to_blocks(x, axis, block)``, [..., n_blocks], reduced in x's
    own layout and dtype: along a non-minor axis, reducing the moved copy would make XLA
    write out a transposed (and upcast) copy of x first."""
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        return abs_max(to_blocks(x, axis, block), axis=-1)
    n = x.shape[axis]
    pad = -n % block
    if pad:
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
    xb = split_axis(x, axis, ((n + pad) // block, block))
    return jnp.moveaxis(abs_max(xb, axis=axis + 1), axis, -1)


def unblocked(xb, n):
    """[..., blocks, block] -> [..., n]: the blocked axis, still last, without its padding."""
    return merge_axes(xb, -2, 2)[..., :n]


def from_blocks(xb, axis, n):
    return jnp.moveaxis(unblocked(xb, n), -1, axis)


def to_tiles(x, tile):
    """[..., R, C] -> zero-padded [..., R/t, t, C/t, t] (t = tile)."""
    r, c = x.shape[-2:]
    pr, pc = -r % tile, -c % tile
    if pr or pc:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pr), (0, pc)])
    x = split_axis(x, -1, ((c + pc) // tile, tile))
    return split_axis(x, -3, ((r + pr) // tile, tile))


def from_tiles(xt, r, c):
    return merge_axes(merge_axes(xt, -2, 2), -3, 2)[..., :r, :c]


def expand(scale, axis, block, n):
    """Repeats block scales along ``axis`` to element resolution (length n)."""
    return lax.slice_in_dim(jnp.repeat(scale, block, axis=axis), 0, n, axis=axis)


def per_element(q: QuantizedTensor, block: int, per_block=None):
    """q's block scales (as float32), or another per-block array, repeated to the shape of
    its data (``block`` elements per scale, or block x block tiles)."""
    scale = q.scale.astype(jnp.float32) if per_block is None else per_block
    shape = q.data.shape
    if q.block_2d:
        return expand(expand(scale, scale.ndim - 2, block, shape[-2]), scale.ndim - 1, block, shape[-1])
    return expand(scale, q.axis, block, shape[q.axis])
