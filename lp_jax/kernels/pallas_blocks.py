"""MXFP8 and NVFP4 block quantization in one read of each tile, both orientations at once.

A tile of the [A, R, C] view is read once and gives:

- the row copy: 1-D blocks along C (the copy a GEMM contracting over C reads), data in the
  tile's layout, one scale per block;
- the column copy: 1-D blocks along R (the wgrad operand, blocked along the tokens), written
  transposed ([A, C, R], TE's columnwise copy, what the GEMM reads in place) or in the
  tile's layout; for NVFP4 optionally after the 16-point RHT along R and with its own
  tensor scale.

Each copy is quantized by ``lp_jax.numerics.quantize``'s own block functions applied to
the tile (mxfp8_blocks, nvfp4_blocks, nvfp4_tiles), so the rounding is the XLA path's by
construction; stochastic rounding draws each element's bits from its place in the layout
the XLA path indexes (lp_jax/kernels/tiles.py), so the same key gives the same bits.

MXFP8 copies with the column copy transposed (or no column copy) go through
``mxfp8_copies``, written slice by slice so that Mosaic GPU lowers it for CUDA; the other
copies (NVFP4, the RHT, an untransposed column copy) through ``block_copies``' whole-tile
form, which runs in the interpreter but does not lower yet (docs/backends.md).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax.kernels.launch import WHOLE, Block, swizzled, tiled_kernel
from lp_jax.kernels.tiles import Tiling, flat_index, noise_at, round_up
from lp_jax.numerics import formats as F
from lp_jax.numerics import quantize as Q
from lp_jax.numerics.hadamard import RHT_SIZE, hadamard


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """One 1-D block copy: its format and rounding (RHT only for a column copy)."""

    fmt: str  # "mxfp8" | "nvfp4"
    scale_rule: str = "rceil"
    stochastic: bool = False
    rht: bool = False

    @property
    def block(self) -> int:
        return F.BLOCK_SIZES[self.fmt]

    @property
    def element(self):
        return F.FORMAT_SPECS[self.fmt].element

    @property
    def scale_dtype(self):
        return jnp.uint8 if self.fmt == "mxfp8" else F.E4M3  # E8M0 leaves as its codes

    def quantize(self, xb, s_enc, noise):
        """xb [..., n, block] -> (data [..., n, block], scales [..., n])."""
        if self.fmt == "mxfp8":
            return Q.mxfp8_blocks(xb, self.scale_rule, per_block_barrier=False)
        return Q.nvfp4_blocks(xb, s_enc, "stochastic" if self.stochastic else "nearest", noise)


def _copy(spec: BlockCopy, x, s_enc, seeds, first, width):
    """Quantizes the rows of tile x [n, m] in blocks along m. first: the flat index of the
    tile's first element in the layout SR indexes (rows of ``width`` elements)."""
    n, m = x.shape
    noise = noise_at(seeds, flat_index((n, m), first[0], first[1], width)) if spec.stochastic else None
    data, scales = spec.quantize(x.reshape(n, m // spec.block, spec.block), s_enc, noise)
    return data.reshape(n, m), scales


def block_copies(x3, t: Tiling, row: BlockCopy | None, col: BlockCopy | None, *, s_enc=None,
                 seeds=None, col_transposed=True, interpret=None):
    """The row and/or column copy of x3 [A, R, C] (padded to whole tiles; R and C of ``t``
    are the logical sizes, a column copy with RHT has R a multiple of 16).

    s_enc: float32 (2,), the NVFP4 tensor scales of the row and column copies; seeds: uint32
    (4,), the SR seeds of the row and column copies (formats.sr_seeds). Returns [row data,
    row scales] + [column data, column scales], padded: row data [A, R, C], scales
    [A, R, C/b]; column data [A, C, R] and scales [A, C, R/b] (transposed) or [A, R, C] and
    [A, R/b, C].
    """
    if col is not None and col.rht and t.r % RHT_SIZE:
        raise ValueError(f"the RHT needs R a multiple of {RHT_SIZE}, got {t.r} (zero-pad it first)")
    specs = [c for c in (row, col) if c is not None]
    if all(c.fmt == "mxfp8" for c in specs) and (col is None or col_transposed):
        return mxfp8_copies(x3, t, row and row.scale_rule, col and col.scale_rule, interpret)
    s_enc = jnp.ones((2,), jnp.float32) if s_enc is None else s_enc
    seeds = jnp.zeros((4,), jnp.uint32) if seeds is None else seeds
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc

    def compute(idx, x, s_enc, seeds):
        a, i, j = idx
        x = x[0]
        out = []
        if row is not None:
            first = (a * t.r + i * tr, j * tc)
            data, scales = _copy(row, x, s_enc[0], (seeds[0], seeds[1]), first, round_up(t.c, row.block))
            out += [data[None], scales[None]]
        if col is not None:
            xc = hadamard(x, axis=0, in_kernel=True) if col.rht else x  # RHT along R, as the XLA path's
            first = (a * t.c + j * tc, i * tr)
            data, scales = _copy(col, xc.T, s_enc[1], (seeds[2], seeds[3]), first, round_up(t.r, col.block))
            out += [data[None], scales[None]] if col_transposed else [data.T[None], scales.T[None]]
        return out

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    swap = lambda a, i, j: (a, j, i)  # noqa: E731
    outs, blocks = [], []
    if row is not None:
        b = row.block
        outs += [jax.ShapeDtypeStruct((a_n, rp, cp), row.element),
                 jax.ShapeDtypeStruct((a_n, rp, cp // b), row.scale_dtype)]
        blocks += [Block((1, tr, tc), tile), Block((1, tr, tc // b), tile)]
    if col is not None:
        b = col.block
        if col_transposed:
            outs += [jax.ShapeDtypeStruct((a_n, cp, rp), col.element),
                     jax.ShapeDtypeStruct((a_n, cp, rp // b), col.scale_dtype)]
            blocks += [Block((1, tc, tr), swap), Block((1, tc, tr // b), swap)]
        else:
            outs += [jax.ShapeDtypeStruct((a_n, rp, cp), col.element),
                     jax.ShapeDtypeStruct((a_n, rp // b, cp), col.scale_dtype)]
            blocks += [Block((1, tr, tc), tile), Block((1, tr // b, tc), tile)]
    ins = [x3, s_enc, seeds]
    in_blocks = [Block((1, tr, tc), tile), WHOLE, WHOLE]
    return tiled_kernel(compute, ins, in_blocks, outs, blocks, t.grid, interpret)


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
    b = F.BLOCK_SIZES["mxfp8"]
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


def nvfp4_tile_copy(x3, t: Tiling, s_enc, *, stochastic=False, seeds=None, interpret=None):
    """NVFP4 with 16x16 tiles over (R, C) (weights): one copy serves both GEMM orientations.
    Returns E2M1 data [A, R, C] and E4M3 scales [A, R/16, C/16], padded."""
    b = Q.NVFP4_BLOCK
    seeds = jnp.zeros((2,), jnp.uint32) if seeds is None else seeds
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc

    def compute(idx, x, s_enc, seeds):
        a, i, j = idx
        x = x[0]
        noise = None
        if stochastic:  # quantize indexes SR bits in the 16-padded [..., R, C] layout
            noise = noise_at(seeds, flat_index((tr, tc), a * round_up(t.r, b) + i * tr, j * tc, round_up(t.c, b)))
        tiles = x.reshape(tr // b, b, tc // b, b)
        data, scales = Q.nvfp4_tiles(tiles, s_enc[0], "stochastic" if stochastic else "nearest", noise)
        return [data.reshape(tr, tc)[None], scales[None]]

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    outs = [jax.ShapeDtypeStruct((a_n, rp, cp), F.E2M1), jax.ShapeDtypeStruct((a_n, rp // b, cp // b), F.E4M3)]
    blocks = [Block((1, tr, tc), tile), Block((1, tr // b, tc // b), tile)]
    return tiled_kernel(compute, [x3, s_enc, seeds], [Block((1, tr, tc), tile), WHOLE, WHOLE],
                        outs, blocks, t.grid, interpret)
