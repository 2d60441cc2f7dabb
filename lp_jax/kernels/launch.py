"""One way to run a tiled Pallas Mosaic GPU kernel: a grid of tiles, each staged through SMEM.

Mosaic GPU kernels see whole arrays in GMEM; a tile moves to SMEM by a TMA copy behind a
barrier and back by an SMEM-to-GMEM copy. ``tiled_kernel`` writes those copies for a kernel
described as blocks (the shape each grid point reads or writes, and where), so a kernel
file states only its arithmetic on the loaded tiles. The grid is ``plgpu.kernel``'s named
grid (read with ``lax.axis_index``): Pallas's GPU interpreter, which runs these kernels on
CPU, supports that but not ``pallas_call`` BlockSpecs with index maps, and it evaluates
``pl.program_id`` as 0 (JAX 0.11.2 and 0.12.0.1).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

GRID_NAMES = ("a", "i", "j")  # batch, tile row, tile column


@dataclasses.dataclass(frozen=True)
class Block:
    """What one grid point (a, i, j) reads or writes of an array: a block of ``shape`` at
    block coordinates ``index(a, i, j)`` (in units of the block shape, as a BlockSpec)."""

    shape: tuple[int, ...]
    index: Callable[..., tuple]

    def window(self, ref, a, i, j):
        idx = self.index(a, i, j)
        return ref.at[tuple(pl.ds(k * n, n) for k, n in zip(idx, self.shape))]


WHOLE = None  # a Block of None: the grid point reads the whole (small) input


_COMPILED = contextvars.ContextVar("lp_jax_pallas_compiled", default=False)


@contextlib.contextmanager
def compiled_kernels() -> Iterator[None]:
    """Kernels traced inside are Mosaic GPU kernels even off the GPU: for lowering a program
    for CUDA on a CPU machine (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``)."""
    token = _COMPILED.set(True)
    try:
        yield
    finally:
        _COMPILED.reset(token)


def interpret_params(interpret: bool | None):
    """Pallas's GPU interpreter off the GPU: ``interpret=None`` runs the kernels compiled
    where JAX's default backend is a GPU (or inside ``compiled_kernels``) and interpreted (on
    CPU) anywhere else."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu" and not _COMPILED.get()
    return plgpu.InterpretGPUParams() if interpret else None


def tiled_kernel(compute: Callable, inputs: Sequence, in_blocks: Sequence[Block | None],
                 out_types: Sequence[jax.ShapeDtypeStruct], out_blocks: Sequence[Block],
                 grid: tuple[int, int, int], interpret: bool | None = None):
    """Runs ``compute(grid_index, *input_tiles) -> output_tiles`` at every point of ``grid``.

    Each input's block (or the whole input, for WHOLE) is copied to SMEM and loaded as an
    array; each output tile goes to SMEM and is copied to its block of the output.
    """
    n_in = len(inputs)
    in_shapes = [b.shape if b is not None else x.shape for x, b in zip(inputs, in_blocks)]

    def body(*refs):
        in_g, out_g = refs[:n_in], refs[n_in:n_in + len(out_types)]
        scratch = refs[n_in + len(out_types):]
        in_s, out_s, barrier = scratch[:n_in], scratch[n_in:-1], scratch[-1]
        a, i, j = (lax.axis_index(n) for n in GRID_NAMES)
        for g, s, blk in zip(in_g, in_s, in_blocks):
            plgpu.copy_gmem_to_smem(g if blk is None else blk.window(g, a, i, j), s, barrier)
            plgpu.barrier_wait(barrier)
        tiles = compute((a, i, j), *(s[...] for s in in_s))
        for s, t in zip(out_s, tiles):
            s[...] = t
        plgpu.commit_smem()
        for g, s, blk in zip(out_g, out_s, out_blocks):
            plgpu.copy_smem_to_gmem(s, blk.window(g, a, i, j))
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(shape, x.dtype) for shape, x in zip(in_shapes, inputs)]
    scratch += [plgpu.SMEM(b.shape, t.dtype) for t, b in zip(out_types, out_blocks)]
    scratch.append(plgpu.Barrier(num_arrivals=1))
    kernel = plgpu.kernel(body, out_type=list(out_types), scratch_types=scratch, grid=grid,
                          grid_names=GRID_NAMES, compiler_params=plgpu.CompilerParams(),
                          interpret=interpret_params(interpret))
    return kernel(*inputs)
