"""NVFP4 kernels in the form Mosaic GPU lowers for CUDA: 1x16 row and column copies (the
column copy optionally after the 16-point RHT along R, with stochastic rounding), 16x16
weight tiles, and the amax after the RHT.

Nothing here reduces along an axis: each tile is read as 16 strided SMEM views of 128
elements, one per position within a block (``strided.Tile``), and a block's amax is an
elementwise max over them. Scales, encode factors, the E2M1 codes and the RHT are then
elementwise too, by the XLA path's own functions (``nvfp4_block_encoding``,
``nvfp4_encode_codes``, ``rht_parts``), so the bits are the XLA path's. Codes are packed two
per byte (low nibble first, as XLA packs E2M1) in 32-bit integers, and XLA turns the bytes
into its E2M1 array by bitcasts (``e2m1_unpack``). Scales are written with the tile's long
side last and swapped to the XLA path's layout after (docs/backends.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lp_jax.kernels.launch import WHOLE, Block, tiled_kernel
from lp_jax.kernels.strided import LANES, Tile, amax_bits, as_f32, iota, is_interpreted, loop, u32
from lp_jax.kernels.tiles import Tiling, round_up
from lp_jax.numerics import formats as F
from lp_jax.numerics import quantize as Q
from lp_jax.numerics.hadamard import rht_parts

B = Q.NVFP4_BLOCK
PAIRS = B // 2  # packed bytes per block
# 16x16 tiles: a 256x128 kernel tile holds 16 x 8 = 128 of them, one per thread.
TILE_2D = (256, 128)


def nvfp4_tiling(shape3) -> Tiling:
    """1-D block kernels: tile sides of 64 or 128 (a power of two, so that 128 blocks fill
    whole rows of the tile, with at least 128 blocks per tile)."""
    a, r, c = shape3
    side = lambda n: 64 if n <= 64 else 128  # noqa: E731
    return Tiling(a, r, c, side(r), side(c))


def tile_2d_tiling(shape3) -> Tiling:
    a, r, c = shape3
    return Tiling(a, r, c, *TILE_2D)


def e2m1_unpack(packed):
    """uint8 [..., n/2] of two codes per byte (low nibble first) -> float4_e2m1fn [..., n]."""
    nibbles = lax.bitcast_convert_type(packed, jnp.uint4)
    return lax.bitcast_convert_type(nibbles.reshape(packed.shape[:-1] + (-1,)), F.E2M1)


def _encode(parts, enc, stochastic, seeds, index):
    """Packed bytes of the 16 (or 16 of a tile row's) positions: [byte m] = code(2m) |
    code(2m+1) << 4. index(k): uint32 flat indices of position k's elements (SR)."""
    codes = []
    for k, p in enumerate(parts):
        noise = (lambda shape, k=k: F.uniform_from_index(seeds, index(k))) if stochastic else None
        codes.append(Q.nvfp4_encode_codes(p, enc, "stochastic" if stochastic else "nearest", noise))
    return [(codes[2 * m] | (codes[2 * m + 1] << 4)).astype(jnp.uint8) for m in range(len(parts) // 2)]


def _rows(x: Tile, data: Tile, scales: Tile, s_enc, stochastic, seeds, first, width):
    """The row copy of the tile x [tr, tc]: blocks along tc. data [tr, tc/2] packed; scales
    [tc/16, tr] (transposed). first: (row, col) of the tile's first element in the layout SR
    indexes, rows of ``width`` elements."""
    tr, tc = x.ref.shape
    nb = tc // B
    rows = tr if x.interpreted else LANES // nb  # the interpreter takes the tile at once

    def chunk(c, carry):
        r = pl.ds(c * rows, rows)
        parts = [x.load((tr, nb, B), None, (r, slice(None), k)) for k in range(B)]
        s_b, enc = Q.nvfp4_block_encoding(as_f32(amax_bits(parts)), s_enc, barrier=False)
        row0 = (u32(first[0]) + u32(c * rows) + iota((rows, nb), 0)) * jnp.uint32(width)
        col0 = u32(first[1]) + iota((rows, nb), 1) * jnp.uint32(B)
        for m, byte in enumerate(_encode(parts, enc, stochastic, seeds, lambda k: row0 + col0 + jnp.uint32(k))):
            data.store((tr, nb, PAIRS), None, (r, slice(None), m), byte)
        scales.store((nb, tr), (1, 0), (r, slice(None)), s_b)
        return carry

    loop(tr // rows, chunk, 0, x.interpreted)


def _row_blocks(x: Tile):
    """Row blocks per step of a column copy: 128 blocks, or the whole tile when interpreted."""
    tr, tc = x.ref.shape
    return tr // B if x.interpreted else LANES // tc


def _col_parts(x: Tile, r, rht):
    tr, tc = x.ref.shape
    parts = [x.load((tr // B, B, tc), None, (r, k, slice(None))) for k in range(B)]
    return [p.astype(jnp.float32) for p in rht_parts(parts)] if rht else parts


def _cols(x: Tile, data: Tile, scales: Tile, s_enc, stochastic, rht, seeds, first, width):
    """The column copy of x [tr, tc]: blocks along tr, after the RHT along tr if asked, written
    transposed: data [tc, tr/2] packed, scales [tr/16, tc]. first: (column, row) of the tile's
    first element in the transposed layout SR indexes, rows of ``width`` elements."""
    tr, tc = x.ref.shape
    nrb = _row_blocks(x)

    def chunk(c, carry):
        r = pl.ds(c * nrb, nrb)
        parts = _col_parts(x, r, rht)
        s_b, enc = Q.nvfp4_block_encoding(as_f32(amax_bits(parts)), s_enc, barrier=False)
        col = (u32(first[0]) + iota((nrb, tc), 1)) * jnp.uint32(width)
        row0 = u32(first[1]) + (u32(c * nrb) + iota((nrb, tc), 0)) * jnp.uint32(B)
        for m, byte in enumerate(_encode(parts, enc, stochastic, seeds, lambda k: col + row0 + jnp.uint32(k))):
            # data [tc, tr/2] seen as [row block, pair, column]
            data.store((tc, tr // B, PAIRS), (1, 2, 0), (r, m, slice(None)), byte)
        scales.store((tr // B, tc), None, (r, slice(None)), s_b)
        return carry

    loop(tr // B // nrb, chunk, 0, x.interpreted)


def rht_amax_bits(x: Tile):
    """max |RHT_R(x)| of the tile x [tr, tc] as a uint32 array of 128 partial maxima."""
    tr, tc = x.ref.shape
    nrb = _row_blocks(x)
    part_max = lambda c: amax_bits(_col_parts(x, pl.ds(c * nrb, nrb), True))  # noqa: E731
    # The loop carries a strided array from the first step (a zeros splat has another layout).
    return loop(tr // B // nrb, lambda c, m: jnp.maximum(m, part_max(c)), part_max(0), x.interpreted, start=1)


def nvfp4_copies(x3, t: Tiling, row: bool, col: bool, *, amax, seeds, row_stochastic=False,
                 col_stochastic=False, rht=False, interpret=None):
    """The NVFP4 row and/or transposed column copy of x3 [A, R, C] (padded to whole tiles of
    ``nvfp4_tiling``; R and C of ``t`` are the logical sizes, R a multiple of 16 with ``rht``).

    amax: (row, column) tensor amaxes, each a float32 vector whose first element is the
    amax its copy's S_enc is computed from, in the kernel (``tensor_amax``'s lane vector,
    read as it is; None for a copy not made); seeds: uint32 (4,), their SR seeds. Returns
    [row data [A, R, C] E2M1, row scales [A, R, C/16]] + [column data [A, C, R], column
    scales [A, C, R/16]], padded."""
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc
    interpreted = is_interpreted(interpret)

    amax_inputs = [m for m, made in zip(amax, (row, col)) if made]

    def compute(idx, x_s, *refs):
        a, i, j = idx
        amax_refs, (seeds_s, *out_s) = list(refs[:len(amax_inputs)]), refs[len(amax_inputs):]
        s_enc = lambda: Q.nvfp4_tensor_scale(amax_refs.pop(0)[0])  # noqa: E731
        x = Tile(x_s.at[0], interpreted)
        outs = [Tile(o.at[0], interpreted) for o in out_s]
        if row:
            d, s = outs.pop(0), outs.pop(0)
            _rows(x, d, s, s_enc(), row_stochastic, (seeds_s[0], seeds_s[1]),
                  (a * t.r + i * tr, j * tc), round_up(t.c, B))
            d.flush(), s.flush()
        if col:
            d, s = outs.pop(0), outs.pop(0)
            _cols(x, d, s, s_enc(), col_stochastic, rht, (seeds_s[2], seeds_s[3]),
                  (a * t.c + j * tc, i * tr), round_up(t.r, B))
            d.flush(), s.flush()

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    swap = lambda a, i, j: (a, j, i)  # noqa: E731
    outs, blocks = [], []
    if row:
        outs += [jax.ShapeDtypeStruct((a_n, rp, cp // 2), jnp.uint8), jax.ShapeDtypeStruct((a_n, cp // B, rp), F.E4M3)]
        blocks += [Block((1, tr, tc // 2), tile), Block((1, tc // B, tr), swap)]
    if col:
        outs += [jax.ShapeDtypeStruct((a_n, cp, rp // 2), jnp.uint8), jax.ShapeDtypeStruct((a_n, rp // B, cp), F.E4M3)]
        blocks += [Block((1, tc, tr // 2), swap), Block((1, tr // B, tc), tile)]
    in_blocks = [Block((1, tr, tc), tile)] + [WHOLE] * (len(amax_inputs) + 1)
    got = tiled_kernel(compute, [x3, *amax_inputs, seeds], in_blocks, outs, blocks, t.grid, interpret, by_ref=True)
    return [e2m1_unpack(o) if n % 2 == 0 else jnp.swapaxes(o, 1, 2) for n, o in enumerate(got)]


def nvfp4_tile_copy(x3, t: Tiling, amax, *, stochastic=False, seeds=None, interpret=None):
    """NVFP4 with 16x16 tiles over (R, C) (weights), x3 padded to ``tile_2d_tiling``'s tiles;
    amax a float32 vector whose first element is the tensor amax (S_enc is computed from it
    in the kernel). Returns E2M1 data [A, R, C] and E4M3 scales [A, R/16, C/16], padded.

    Each of the kernel tile's 16 x 8 16x16 tiles is one element of the [16, 8] arrays: the
    view of row k, column l of every tile. A first pass over k takes the tile amaxes, a
    second encodes row k's 16 views and stores its packed bytes."""
    seeds = jnp.zeros((2,), jnp.uint32) if seeds is None else seeds
    a_n, rp, cp = t.padded
    tr, tc = t.tr, t.tc
    nrb, nb = tr // B, tc // B
    if (tr, tc) != TILE_2D:
        raise ValueError(f"the 16x16 tile kernel takes {TILE_2D} kernel tiles, got {(tr, tc)}")
    interpreted = is_interpreted(interpret)

    def compute(idx, x_s, amax_s, seeds_s, data_s, scales_s):
        a, i, j = idx
        x, data, scales = (Tile(r.at[0], interpreted) for r in (x_s, data_s, scales_s))
        # Compiled: row k of every 16x16 tile at a time ([16, 8] arrays). Interpreted: all
        # 16 rows at once ([16, 16, 8], k the middle axis), which the interpreter runs faster.
        ks = slice(None) if interpreted else None
        on_k = (lambda v: v[:, None, :]) if interpreted else (lambda v: v)  # noqa: E731
        row_parts = lambda k: [x.load((nrb, B, nb, B), None, (slice(None), k, slice(None), l))  # noqa: E731
                               for l in range(B)]
        if interpreted:
            amax = jnp.max(amax_bits(row_parts(ks)), axis=1)
        else:
            amax = lax.fori_loop(1, B, lambda k, m: jnp.maximum(m, amax_bits(row_parts(k))),
                                 amax_bits(row_parts(0)))
        s_b, enc = Q.nvfp4_block_encoding(as_f32(amax), Q.nvfp4_tensor_scale(amax_s[0]), barrier=False)
        scales.store((nb, nrb), (1, 0), (slice(None), slice(None)), s_b)
        # quantize indexes SR bits in the 16-padded [..., R, C] layout
        row = on_k(u32(a * round_up(t.r, B) + i * tr) + iota((nrb, nb), 0) * jnp.uint32(B))
        col = on_k(u32(j * tc) + iota((nrb, nb), 1) * jnp.uint32(B))

        def encode_rows(k, carry):
            kk = lax.broadcasted_iota(jnp.uint32, (1, B, 1), 1) if interpreted else u32(k)
            base = (row + kk) * jnp.uint32(round_up(t.c, B)) + col
            packed = _encode(row_parts(k), on_k(enc), stochastic, (seeds_s[0], seeds_s[1]),
                             lambda l: base + jnp.uint32(l))
            for m, byte in enumerate(packed):
                data.store((nrb, B, nb, PAIRS), None, (slice(None), k, slice(None), m), byte)
            return carry

        if interpreted:
            encode_rows(ks, 0)
        else:
            lax.fori_loop(0, B, encode_rows, 0)
        data.flush(), scales.flush()

    tile = lambda a, i, j: (a, i, j)  # noqa: E731
    outs = [jax.ShapeDtypeStruct((a_n, rp, cp // 2), jnp.uint8), jax.ShapeDtypeStruct((a_n, cp // B, rp // B), F.E4M3)]
    blocks = [Block((1, tr, tc // 2), tile), Block((1, nb, nrb), lambda a, i, j: (a, j, i))]
    data, scales = tiled_kernel(compute, [x3, amax, seeds], [Block((1, tr, tc), tile), WHOLE, WHOLE],
                                outs, blocks, t.grid, interpret, by_ref=True)
    return e2m1_unpack(data), jnp.swapaxes(scales, 1, 2)
