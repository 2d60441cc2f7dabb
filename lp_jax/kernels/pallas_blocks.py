"""MXFP8 block quantization in one read of each tile, both orientations at once.

A tile of the [A, R, C] view gives the row copy (1x32 blocks along C, in the tile's layout)
and the column copy (1x32 blocks along R, the wgrad operand: written transposed, [A, C, R],
as TE's columnwise copy the GEMM reads in place, or in the tile's layout), each with one
E8M0 code per block. Each copy is quantized by ``lp_jax.numerics.quantize.mxfp8_blocks``
applied to the tile, so the rounding is the XLA path's by construction. ``mxfp8_copies``
and ``mxfp8_col_copy`` are two forms Mosaic GPU lowers for CUDA; ``block_copies`` picks one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax.kernels.launch import Block, swizzled, tiled_kernel
from lp_jax.kernels.strided import LANES, Tile, amax_bits, as_f32, is_interpreted, loop
from lp_jax.kernels.tiles import Tiling
from lp_jax.numerics import formats as F
from lp_jax.numerics import quantize as Q


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """One MXFP8 1x32 block copy and its E8M0 scale rule."""

    fmt: str  # "mxfp8"
    scale_rule: str = "rceil"

    @property
    def block(self) -> int:
        return Q.format_named(self.fmt).block


def block_copies(x3, t: Tiling, row: BlockCopy | None, col: BlockCopy | None, *, col_transposed=True,
                 interpret=None):
    """The row and/or column copy of x3 [A, R, C] (padded to whole tiles). Returns [row data,
    row scales] + [column data, column scales], padded: row data [A, R, C], scales
    [A, R, C/32]; column data [A, C, R] and scales [A, C, R/32] (transposed) or [A, R, C] and
    [A, R/32, C].

    Both copies come from one kernel (``mxfp8_copies``) except where its WGMMA-layout column
    copy does not lower: in place, and transposed from float32 (a transposed 32-bit load);
    those take ``mxfp8_col_copy``'s strided views, a second read of the tile."""
    if col is None or (col_transposed and x3.dtype.itemsize == 2):
        return mxfp8_copies(x3, t, row and row.scale_rule, col and col.scale_rule, interpret)
    rows = list(mxfp8_copies(x3, t, row.scale_rule, None, interpret)) if row is not None else []
    return rows + mxfp8_col_copy(x3, t, col.scale_rule, col_transposed, interpret)


def mxfp8_col_copy(x3, t: Tiling, rule: str, transposed: bool, interpret=None):
    """The MXFP8 column copy (1x32 blocks along R): data [A, C, R] and codes [A, C, R/32]
    (transposed) or data [A, R, C] and codes [A, R/32, C], padded. Mosaic GPU has no
    transposed 8-bit store from the WGMMA layout and no 32-row WGMMA slice (docs/backends.md),
    so the tile is read as 32 strided row views (``strided.Tile``: view k holds row k of 128
    blocks), the block amax is their elementwise max, and each view is scaled, cast and
    stored, in place or through a transposed view of the output: ``mxfp8_blocks``'
    arithmetic, elementwise."""
    b = Q.MX_BLOCK
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc
    interpreted = is_interpreted(interpret)
    # the data as [row block, row in block, column]: the tile's layout, or the transposed output's
    data_view = ((tc, tr // b, b), (1, 2, 0)) if transposed else ((tr // b, b, tc), None)

    def compute(_, x_s, data_s, codes_s):
        x, data, codes = (Tile(r.at[0], interpreted) for r in (x_s, data_s, codes_s))
        nrb = tr // b if interpreted else LANES // tc  # row blocks per step (all when interpreted)

        def chunk(c, carry):
            r = pl.ds(c * nrb, nrb)
            parts = [x.load((tr // b, b, tc), None, (r, k, slice(None))) for k in range(b)]
            code, f1, f2 = Q.mxfp8_block_factors(as_f32(amax_bits(parts)), rule)
            for k, p in enumerate(parts):
                data.store(*data_view, (r, k, slice(None)), F.cast_satfinite(p * f1 * f2, F.E4M3))
            codes.store((tr // b, tc), None, (r, slice(None)), code)
            return carry

        loop(tr // b // nrb, chunk, 0, interpreted)
        data.flush(), codes.flush()

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    swap = lambda a, i, j: (a, j, i)  # noqa: E731
    data_out = (jax.ShapeDtypeStruct((a_n, cp, rp), F.E4M3), Block((1, tc, tr), swap)) if transposed else (
        jax.ShapeDtypeStruct((a_n, rp, cp), F.E4M3), Block((1, tr, tc), tile))
    outs = [data_out[0], jax.ShapeDtypeStruct((a_n, rp // b, cp), jnp.uint8)]
    blocks = [data_out[1], Block((1, tr // b, tc), tile)]
    data, codes = tiled_kernel(compute, [x3], [Block((1, tr, tc), tile)], outs, blocks, t.grid, interpret,
                               by_ref=True)
    return [data, jnp.swapaxes(codes, 1, 2) if transposed else codes]


def mxfp8_copies(x3, t: Tiling, row_rule: str | None, col_rule: str | None, interpret=None):
    """MXFP8 row copy and/or transposed column copy, in a form Mosaic GPU lowers for CUDA.

    Each tile is taken 32 columns (row copy) or 32 rows (column copy, through a transposed
    view of the SMEM tile) at a time, in the WGMMA register layout, where a max along the
    slice's 32 elements is a supported reduction, and quantized by ``mxfp8_blocks`` as the
    XLA path. Slice k's scales are written as row k ([A, C/32, R] for the row copy, [A,
    R/32, C] for the column copy) and swapped to the XLA path's layout after (an XLA pass
    over 1/32 of the data's bytes). Mosaic GPU has no transposed store of 8-bit data, so
    the column copy comes only transposed ([A, C, R]).
    Returns [row data, row scales] + [column data, column scales], as ``block_copies``."""
    b = Q.MX_BLOCK
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc
    rules = [r for r in (row_rule, col_rule) if r is not None]

    def compute(_, x_s, *out_s):
        views = [x_s.at[0]] * (row_rule is not None) + [x_s.at[0].transpose((1, 0))] * (col_rule is not None)
        for rule, view, data_s, scales_s in zip(rules, views, out_s[::2], out_s[1::2]):
            for k in range(view.shape[1] // b):
                cols = pl.ds(k * b, b)
                data, code = Q.mxfp8_blocks(plgpu.load(view.at[:, cols], layout=plgpu.Layout.WGMMA), rule,
                                               per_block_barrier=False)
                data_s.at[0, :, cols][...] = data
                scales_s.at[0, k][...] = code

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    swap = lambda a, i, j: (a, j, i)  # noqa: E731
    outs, blocks = [], []
    if row_rule is not None:
        outs += [jax.ShapeDtypeStruct((a_n, rp, cp), F.E4M3), jax.ShapeDtypeStruct((a_n, cp // b, rp), jnp.uint8)]
        blocks += [Block((1, tr, tc), tile, swizzled(1, b)), Block((1, tc // b, tr), swap)]
    if col_rule is not None:
        outs += [jax.ShapeDtypeStruct((a_n, cp, rp), F.E4M3), jax.ShapeDtypeStruct((a_n, rp // b, cp), jnp.uint8)]
        blocks += [Block((1, tc, tr), swap, swizzled(1, b)), Block((1, tr // b, tc), tile)]
    item = x3.dtype.itemsize
    out = tiled_kernel(compute, [x3], [Block((1, tr, tc), tile, swizzled(item, b * item))],
                       outs, blocks, t.grid, interpret, by_ref=True)
    return [jnp.swapaxes(o, 1, 2) if n % 2 else o for n, o in enumerate(out)]
