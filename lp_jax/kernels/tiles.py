"""How the quantization kernels cut a tensor into tiles, and where each tile sits.

Every kernel sees a 3-D view ``[A, R, C]`` of its tensor (A: a batch of independent
matrices, e.g. the leading axes of a blocked-along-a-middle-axis tensor) and runs one grid
point per (a, R-tile, C-tile). Tiles are multiples of 32 on both sides (64 for MXFP8, whose
kernel needs 64-row register tiles; NVFP4's kernels choose their own: ``pallas_nvfp4``);
a ragged tensor is zero-padded to whole tiles first (zeros change no block's amax and are
sliced off after).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MAX_TILE = 128  # a 128x128 bf16 tile is 32 KiB of SMEM; outputs need at most as much again
TILE_MULTIPLE = 32  # the MXFP8 block; a multiple of NVFP4's 16
# The MXFP8 kernels hold a tile's 32-wide slices in the WGMMA register layout, whose rows
# come in 64s (Mosaic GPU: "Tiling ((64, 8), ...) does not apply to shape (96, 32)").
WGMMA_TILE_MULTIPLE = 64


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Tiling:
    a: int
    r: int
    c: int
    tr: int
    tc: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.a, round_up(self.r, self.tr) // self.tr, round_up(self.c, self.tc) // self.tc)

    @property
    def padded(self) -> tuple[int, int, int]:
        return (self.a, self.grid[1] * self.tr, self.grid[2] * self.tc)


def tiling(shape3, max_tile: int = MAX_TILE, multiple: int = TILE_MULTIPLE) -> Tiling:
    a, r, c = shape3
    side = lambda n: min(max_tile, round_up(max(n, 1), multiple))  # noqa: E731
    return Tiling(a, r, c, side(r), side(c))


def pad(x3, t: Tiling):
    """x3 zero-padded to whole tiles (a no-op, no copy, when it already is)."""
    widths = [(0, p - n) for n, p in zip(x3.shape, t.padded)]
    return jnp.pad(x3, widths) if any(w for _, w in widths) else x3
