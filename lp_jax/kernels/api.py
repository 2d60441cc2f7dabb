"""``lp.quantize(..., impl="pallas")``: the Pallas kernels behind the QuantizedTensor API.

Gives, bit for bit, what the XLA path gives. A tensor of any rank is seen as [A, R, C]:
blocks along the last axis are the row copy of [1, leading, n]; blocks along another axis
the column copy of [leading, n, trailing] (blocked along its middle axis, in place); 16x16
tiles cover [leading, r, c]. A ragged tensor is zero-padded to whole tiles before the
kernel and sliced after: an extra XLA pass for such shapes only, never different bits.
Each scheme's kernels are registered below under the format object's ``scheme``; which
formats have kernels is the object's ``pallas``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from lp_jax.kernels.amax import lane, tensor_amax
from lp_jax.kernels.pallas_blocks import BlockCopy, block_copies
from lp_jax.kernels.pallas_fp8 import fp8_cast
from lp_jax.kernels.pallas_nvfp4 import nvfp4_copies, nvfp4_tile_copy, nvfp4_tiling, tile_2d_tiling
from lp_jax.kernels.tiles import WGMMA_TILE_MULTIPLE, pad, tiling
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import NVFP4_BLOCK, QuantizedTensor, nvfp4_tensor_scale, tensor_scale_fp8
from lp_jax.numerics.registry import Format, format_named


def scale_codes(scales, fmt):
    """The kernels write E8M0 scales (MXFP8's) as their uint8 codes; this is the E8M0 array."""
    return F.e8m0_from_code(scales) if format_named(fmt).scale is F.E8M0 else scales


def sr_seed_pair(key, stochastic):
    return F.sr_seeds(key) if stochastic else jnp.zeros((2,), jnp.uint32)


def quantize_pallas(x, fmt, axis, *, block_2d=False, rounding="nearest", key=None,
                    scale_rule="rceil", interpret=None) -> QuantizedTensor:
    """What ``lp.quantize(x, fmt, axis, ...)`` returns, computed by the Pallas kernels.
    Arguments are checked by ``quantize``; x is bf16 or f32, axis non-negative."""
    spec = format_named(fmt)
    if spec.per_tensor:
        return _per_tensor(x, spec, axis, interpret)
    stochastic = rounding == "stochastic"
    seeds = sr_seed_pair(key, stochastic)
    if block_2d:
        return _TILE_QUANTIZERS[spec.scheme](x, spec, stochastic, seeds, interpret)
    shape, ndim = x.shape, x.ndim
    n = shape[axis]
    nb = -(-n // spec.block)
    last = axis == ndim - 1
    x3 = x.reshape(1, -1, n) if last else x.reshape(math.prod(shape[:axis]), n, math.prod(shape[axis + 1:]))
    t, data, scales, global_scale = _BLOCK_QUANTIZERS[spec.scheme](x3, spec, last, stochastic, seeds,
                                                                   scale_rule, interpret)
    if last:
        data, scales = data[0, :t.r, :t.c], scales[0, :t.r, :nb]
        scale_shape = shape[:-1] + (nb,)
    else:
        data, scales = data[:, :t.r, :t.c], scales[:, :nb, :t.c]
        scale_shape = shape[:axis] + (nb,) + shape[axis + 1:]
    return QuantizedTensor(data.reshape(shape), scale_codes(scales, fmt).reshape(scale_shape), global_scale,
                           fmt, axis)


def _per_tensor(x, spec: Format, axis, interpret):
    shape, ndim = x.shape, x.ndim
    x3 = x.reshape((1, math.prod(shape[:-1]), shape[-1]) if ndim else (1, 1, 1))
    t = tiling(x3.shape)
    xp = pad(x3, t)
    (amax,) = tensor_amax(xp, t, interpret=interpret)
    (data,) = fp8_cast(xp, amax, spec.element, t, interpret=interpret)
    data = data[:, :t.r, :t.c].reshape(shape)
    return QuantizedTensor(data, F.recip(tensor_scale_fp8(lane(amax), spec.max)), None, spec.name, axis)


def _nvfp4_tiles(x, spec: Format, stochastic, seeds, interpret):
    shape, ndim = x.shape, x.ndim
    r, c = shape[-2:]
    x3 = x.reshape(-1, r, c)
    t = tile_2d_tiling(x3.shape)
    xp = pad(x3, t)
    (amax,) = tensor_amax(xp, t, interpret=interpret)
    data, scales = nvfp4_tile_copy(xp, t, amax, stochastic=stochastic, seeds=seeds, interpret=interpret)
    s_enc = nvfp4_tensor_scale(lane(amax))
    nr, nc = -(-r // NVFP4_BLOCK), -(-c // NVFP4_BLOCK)
    return QuantizedTensor(data[:, :r, :c].reshape(shape), scales[:, :nr, :nc].reshape(shape[:-2] + (nr, nc)),
                           F.recip(s_enc), spec.name, ndim - 1, True)


def _nvfp4_blocks(x3, spec: Format, last, stochastic, seeds, scale_rule, interpret):
    """(tiling, data, scales, global scale) of x3's row copy (last) or column copy."""
    t = nvfp4_tiling(x3.shape)
    xp = pad(x3, t)
    (amax,) = tensor_amax(xp, t, interpret=interpret)
    data, scales = nvfp4_copies(xp, t, last, not last, amax=(amax, amax),
                                seeds=jnp.concatenate([seeds, seeds]), row_stochastic=stochastic,
                                col_stochastic=stochastic, interpret=interpret)
    if not last:  # the kernel writes the column copy transposed; XLA swaps it back
        data, scales = jnp.swapaxes(data, 1, 2), jnp.swapaxes(scales, 1, 2)
    return t, data, scales, F.recip(nvfp4_tensor_scale(lane(amax)))


def _mx_blocks(x3, spec: Format, last, stochastic, seeds, scale_rule, interpret):
    t = tiling(x3.shape, multiple=WGMMA_TILE_MULTIPLE)
    copy = BlockCopy(spec.name, scale_rule)
    data, scales = block_copies(pad(x3, t), t, copy if last else None, None if last else copy,
                                col_transposed=False, interpret=interpret)
    return t, data, scales, None


def block_pair(t, row_spec=None, col_spec=None, row_key=None, col_key=None, interpret=None):
    """The 1-D block copies of a 2-D GEMM operand t [R, C] in one read: the row copy
    (blocked along C: a QuantizedTensor with axis 1) and the column copy (blocked along R,
    after the RHT if its spec says so: the transposed QuantizedTensor of
    ``stored(t, col_spec, axis=0)``, R zero-padded to 16 for the RHT as the XLA path pads).
    Specs: recipe OperandSpecs of one block format, or None for a copy not wanted."""
    r, c = t.shape
    fmt = (row_spec or col_spec).fmt
    rht = col_spec is not None and col_spec.rht
    if rht and r % NVFP4_BLOCK:
        t = jnp.pad(t, ((0, -r % NVFP4_BLOCK), (0, 0)))  # exact: the XLA path pads the same
    spec = format_named(fmt)
    block = spec.block
    tl, outs, s_enc = _PAIR_COPIES[spec.scheme](t[None], row_spec, col_spec, row_key, col_key, rht, interpret)
    outs = list(outs)
    row_q = col_q = None
    if row_spec is not None:
        data, scales = outs.pop(0), outs.pop(0)
        nb = -(-c // block)
        row_q = QuantizedTensor(data[0, :r, :c], scale_codes(scales[0, :r, :nb], fmt),
                                None if s_enc is None else F.recip(s_enc[0]), fmt, 1)
    if col_spec is not None:
        data, scales = outs.pop(0), outs.pop(0)
        rr = tl.r
        nb = -(-rr // block)
        col_q = QuantizedTensor(data[0, :c, :rr], scale_codes(scales[0, :c, :nb], fmt),
                                None if s_enc is None else F.recip(s_enc[1]), fmt, 1)
    return row_q, col_q


def _nvfp4_pair(x3, row_spec, col_spec, row_key, col_key, rht, interpret):
    """(tiling, [row data, row scales] + [column data, column scales], (row S_enc, column S_enc))."""
    tl = nvfp4_tiling(x3.shape)
    xp = pad(x3, tl)
    amaxes = tensor_amax(xp, tl, plain=row_spec is not None or not rht, rht=rht, interpret=interpret)
    s_enc = (nvfp4_tensor_scale(lane(amaxes[0])), nvfp4_tensor_scale(lane(amaxes[-1])))
    stochastic = lambda s: s is not None and s.stochastic  # noqa: E731
    seeds = jnp.concatenate([sr_seed_pair(row_key, stochastic(row_spec)), sr_seed_pair(col_key, stochastic(col_spec))])
    outs = nvfp4_copies(xp, tl, row_spec is not None, col_spec is not None, amax=(amaxes[0], amaxes[-1]),
                        seeds=seeds, row_stochastic=stochastic(row_spec),
                        col_stochastic=stochastic(col_spec), rht=rht, interpret=interpret)
    return tl, outs, s_enc


def _mx_pair(x3, row_spec, col_spec, row_key, col_key, rht, interpret):
    tl = tiling(x3.shape, multiple=WGMMA_TILE_MULTIPLE)
    row, col = (None if s is None else BlockCopy(s.fmt, s.scale_rule) for s in (row_spec, col_spec))
    return tl, block_copies(pad(x3, tl), tl, row, col, interpret=interpret), None


# Each scheme's kernels, by the format object's ``scheme`` (formats with ``pallas``): 16x16
# tiles (``tiles``), 1-D blocks along one axis, and both 1-D copies of a 2-D operand in one read.
_TILE_QUANTIZERS = {"nvfp4": _nvfp4_tiles}
_BLOCK_QUANTIZERS = {"nvfp4": _nvfp4_blocks, "mxfp8": _mx_blocks}
_PAIR_COPIES = {"nvfp4": _nvfp4_pair, "mxfp8": _mx_pair}
