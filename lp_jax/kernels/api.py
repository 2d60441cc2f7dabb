"""``lp.quantize(..., impl="pallas")``: the Pallas kernels behind the QuantizedTensor API.

Gives, bit for bit, what the XLA path gives (tests/test_pallas_quantize.py). A tensor of
any rank is seen as [A, R, C]: blocks along the last axis are the row copy of
[1, leading, n]; blocks along another axis the column copy of [leading, n, trailing]
(blocked along its middle axis, in place); 16x16 tiles cover [leading, r, c]. A ragged
tensor is zero-padded to whole tiles before the kernel and sliced after: an extra XLA pass
for such shapes only, never different bits.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from lp_jax.kernels.amax import tensor_amax
from lp_jax.kernels.pallas_blocks import BlockCopy, block_copies, nvfp4_tile_copy
from lp_jax.kernels.pallas_fp8 import fp8_cast
from lp_jax.kernels.tiles import TILE_MULTIPLE, WGMMA_TILE_MULTIPLE, pad, tiling
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import (NVFP4_BLOCK, QuantizedTensor, nvfp4_tensor_scale,
                                      tensor_scale_fp8)


def scale_codes(scales, fmt):
    """The kernels write MXFP8's E8M0 scales as their uint8 codes; this is the E8M0 array."""
    return F.e8m0_from_code(scales) if fmt == "mxfp8" else scales


def sr_seed_pair(key, stochastic):
    return F.sr_seeds(key) if stochastic else jnp.zeros((2,), jnp.uint32)


def quantize_pallas(x, fmt, axis, *, block_2d=False, rounding="nearest", key=None,
                    scale_rule="rceil", interpret=None) -> QuantizedTensor:
    """What ``lp.quantize(x, fmt, axis, ...)`` returns, computed by the Pallas kernels.
    Arguments are checked by ``quantize``; x is bf16 or f32, axis non-negative."""
    shape, ndim = x.shape, x.ndim
    if fmt in F.PER_TENSOR_FORMATS:
        x3 = x.reshape((1, math.prod(shape[:-1]), shape[-1]) if ndim else (1, 1, 1))
        t = tiling(x3.shape)
        xp = pad(x3, t)
        (amax,) = tensor_amax(xp, t, interpret=interpret)
        dtype = F.FORMAT_SPECS[fmt].element
        (data,) = fp8_cast(xp, amax.reshape(1), dtype, t, interpret=interpret)
        data = data[:, :t.r, :t.c].reshape(shape)
        return QuantizedTensor(data, F.recip(tensor_scale_fp8(amax, F.max_of(dtype))), None, fmt, axis)

    stochastic = rounding == "stochastic"
    seeds = sr_seed_pair(key, stochastic)
    if block_2d:
        r, c = shape[-2:]
        x3 = x.reshape(-1, r, c)
        t = tiling(x3.shape)
        xp = pad(x3, t)
        (amax,) = tensor_amax(xp, t, interpret=interpret)
        s_enc = nvfp4_tensor_scale(amax)
        data, scales = nvfp4_tile_copy(xp, t, s_enc.reshape(1), stochastic=stochastic, seeds=seeds,
                                       interpret=interpret)
        nr, nc = -(-r // NVFP4_BLOCK), -(-c // NVFP4_BLOCK)
        return QuantizedTensor(data[:, :r, :c].reshape(shape), scales[:, :nr, :nc].reshape(shape[:-2] + (nr, nc)),
                               F.recip(s_enc), fmt, ndim - 1, True)

    spec = BlockCopy(fmt, scale_rule, stochastic)
    n, b = shape[axis], spec.block
    nb = -(-n // b)
    last = axis == ndim - 1
    x3 = x.reshape(1, -1, n) if last else x.reshape(math.prod(shape[:axis]), n, math.prod(shape[axis + 1:]))
    t = tiling(x3.shape, multiple=tile_multiple(fmt))
    xp = pad(x3, t)
    s_enc = None
    if fmt == "nvfp4":
        (amax,) = tensor_amax(xp, t, interpret=interpret)
        s_enc = nvfp4_tensor_scale(amax)
    pair = lambda v: None if v is None else jnp.stack([v, v])  # noqa: E731
    seeds4 = jnp.concatenate([seeds, seeds])
    if last:
        data, scales = block_copies(xp, t, spec, None, s_enc=pair(s_enc), seeds=seeds4, interpret=interpret)
        data, scales = data[0, :t.r, :t.c], scales[0, :t.r, :nb]
        scale_shape = shape[:-1] + (nb,)
    else:
        data, scales = block_copies(xp, t, None, spec, s_enc=pair(s_enc), seeds=seeds4, col_transposed=False,
                                    interpret=interpret)
        data, scales = data[:, :t.r, :t.c], scales[:, :nb, :t.c]
        scale_shape = shape[:axis] + (nb,) + shape[axis + 1:]
    global_scale = None if s_enc is None else F.recip(s_enc)
    return QuantizedTensor(data.reshape(shape), scale_codes(scales, fmt).reshape(scale_shape), global_scale,
                           fmt, axis)


def _block_copy(spec) -> BlockCopy:
    """The kernel's BlockCopy for a recipe's OperandSpec (a 1-D block format)."""
    return BlockCopy(spec.fmt, spec.scale_rule, spec.stochastic, spec.rht)


def tile_multiple(fmt):
    """Tile sides for a block format's kernels (see tiles.WGMMA_TILE_MULTIPLE)."""
    return WGMMA_TILE_MULTIPLE if fmt == "mxfp8" else TILE_MULTIPLE


def block_pair(t, row_spec=None, col_spec=None, row_key=None, col_key=None, interpret=None):
    """The 1-D block copies of a 2-D GEMM operand t [R, C] in one read: the row copy
    (blocked along C: a QuantizedTensor with axis 1) and the column copy (blocked along R,
    after the RHT if its spec says so: the transposed QuantizedTensor of
    ``stored(t, col_spec, axis=0)``, R zero-padded to 16 for the RHT as the XLA path pads).
    Specs: recipe OperandSpecs of one block format, or None for a copy not wanted."""
    r, c = t.shape
    row = None if row_spec is None else _block_copy(row_spec)
    col = None if col_spec is None else _block_copy(col_spec)
    if col is not None and col.rht and r % NVFP4_BLOCK:
        t = jnp.pad(t, ((0, -r % NVFP4_BLOCK), (0, 0)))  # exact: the XLA path pads the same
    x3 = t[None]
    tl = tiling(x3.shape, multiple=tile_multiple((row or col).fmt))
    xp = pad(x3, tl)
    s_enc = None
    if (row or col).fmt == "nvfp4":
        want_plain = row is not None or not col.rht
        amaxes = tensor_amax(xp, tl, plain=want_plain, rht=col is not None and col.rht, interpret=interpret)
        s_enc = jnp.stack([nvfp4_tensor_scale(amaxes[0]), nvfp4_tensor_scale(amaxes[-1])])
    seeds = jnp.concatenate([sr_seed_pair(row_key, row is not None and row.stochastic),
                             sr_seed_pair(col_key, col is not None and col.stochastic)])
    outs = list(block_copies(xp, tl, row, col, s_enc=s_enc, seeds=seeds, interpret=interpret))
    row_q = col_q = None
    if row is not None:
        data, scales = outs.pop(0), outs.pop(0)
        nb = -(-c // row.block)
        row_q = QuantizedTensor(data[0, :r, :c], scale_codes(scales[0, :r, :nb], row.fmt),
                                None if s_enc is None else F.recip(s_enc[0]), row.fmt, 1)
    if col is not None:
        data, scales = outs.pop(0), outs.pop(0)
        rr = tl.r
        nb = -(-rr // col.block)
        col_q = QuantizedTensor(data[0, :c, :rr], scale_codes(scales[0, :c, :nb], col.fmt),
                                None if s_enc is None else F.recip(s_enc[1]), col.fmt, 1)
    return row_q, col_q
