"""One way to run a tiled Pallas Mosaic GPU kernel: a grid of tiles, each staged through SMEM.

Mosaic GPU kernels see whole arrays in GMEM; a tile moves to SMEM by a TMA copy behind a
barrier and back by an SMEM-to-GMEM copy. ``tiled_kernel`` writes those copies for a kernel
described as blocks (the shape each grid point reads or writes, and where), so a kernel
file states only its arithmetic on the loaded tiles. The grid is ``plgpu.kernel``'s named
grid (read with ``lax.axis_index``), the form Pallas's GPU interpreter also runs on CPU
(docs/backends.md).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax.kernels.cuda_target import cuda_major
from lp_jax.numerics.division import integer_division

GRID_NAMES = ("a", "i", "j")  # batch, tile row, tile column


@dataclasses.dataclass(frozen=True)
class Block:
    """What one grid point (a, i, j) reads or writes of an array: a block of ``shape`` at
    block coordinates ``index(a, i, j)`` (in units of the block shape, as a BlockSpec)."""

    shape: tuple[int, ...]
    index: Callable[..., tuple]
    # SMEM layout of the tile (plgpu.TilingTransform, SwizzleTransform): Mosaic GPU loads
    # and stores a register layout such as WGMMA's without bank conflicts only from a
    # swizzled tile; the copies between GMEM and SMEM apply it, the values are the same.
    transforms: tuple = ()

    def window(self, ref, a, i, j):
        idx = self.index(a, i, j)
        return ref.at[tuple(pl.ds(k * n, n) for k, n in zip(idx, self.shape))]


WHOLE = None  # a Block of None: the grid point reads the whole (small) input

# Mosaic GPU copies to and from SMEM move a multiple of 128 bytes, and a vector it stores
# holds a multiple of 128 elements: a WHOLE input (a few scalars) is zero-padded to this
# many elements, and a per-tile value is written as this many copies.
SMEM_LANES = 128

# Lane semantics (each thread holds part of a tile, Mosaic GPU's own layouts): the
# warpgroup semantics' layout inference (the default) refuses these kernels, e.g. a
# reduction of a tile to one value ("Scalars must be represented by non-vector types").
COMPILER_PARAMS = dict(lowering_semantics=plgpu.LoweringSemantics.Lane)


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


def cuda_lowering_error(fn, *args) -> str | None:
    """None if ``fn(*args)`` (avals or arrays) lowers for CUDA with its kernels compiled by
    Mosaic GPU, else the error's type and first line. Mosaic GPU lowers on the host, so
    this needs no GPU (compiling to a GPU binary does)."""
    try:
        with compiled_kernels():
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - the message is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def compiled_for_major() -> int | None:
    """The major compute capability kernels traced now are compiled for (the process's GPU,
    or the one a deviceless compile describes inside ``compiled_kernels``; 10 when neither
    names one, ``cuda_major``'s Blackwell-or-later form), or None where they are interpreted
    (off the GPU)."""
    if jax.default_backend() != "gpu" and not _COMPILED.get():
        return None
    major = cuda_major()
    return 10 if major is None else major


def interpret_params(interpret: bool | None):
    """Pallas's GPU interpreter off the GPU: ``interpret=None`` runs the kernels compiled
    where JAX's default backend is a GPU (or inside ``compiled_kernels``) and interpreted (on
    CPU) anywhere else."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu" and not _COMPILED.get()
    return plgpu.InterpretGPUParams() if interpret else None


def tiled_kernel(compute: Callable, inputs: Sequence, in_blocks: Sequence[Block | None],
                 out_types: Sequence[jax.ShapeDtypeStruct], out_blocks: Sequence[Block],
                 grid: tuple[int, int, int], interpret: bool | None = None, by_ref: bool = False):
    """Runs ``compute(grid_index, *input_tiles) -> output_tiles`` at every point of ``grid``.

    With ``by_ref``, ``compute(grid_index, *input_refs, *output_refs)`` gets the SMEM refs
    of every input and output tile and loads and stores parts of them itself (a kernel that
    works on a tile slice by slice, in register layouts it chooses).

    Each input's block is copied to SMEM and loaded as an array; a WHOLE input (a few
    scalars: scales, seeds) is copied to SMEM and handed over as its SMEM ref, so that
    ``ref[k]`` reads a scalar (Mosaic GPU lowers a scalar read from a ref, not one taken
    out of a loaded vector). Each output tile goes to SMEM and is copied to its block.
    """
    n_in = len(inputs)
    params = interpret_params(interpret)
    inputs = [x if b is not None else _pad_lanes(x) for x, b in zip(inputs, in_blocks)]
    in_shapes = [b.shape if b is not None else x.shape for x, b in zip(inputs, in_blocks)]

    def body(*refs):
        in_g, out_g = refs[:n_in], refs[n_in:n_in + len(out_types)]
        scratch = refs[n_in + len(out_types):]
        in_s, out_s, barrier = scratch[:n_in], scratch[n_in:-1], scratch[-1]
        a, i, j = (lax.axis_index(n) for n in GRID_NAMES)
        for g, s, blk in zip(in_g, in_s, in_blocks):
            plgpu.copy_gmem_to_smem(g if blk is None else blk.window(g, a, i, j), s, barrier)
            plgpu.barrier_wait(barrier)
        # Mosaic GPU divides approximately and has no per-platform branches: compiled, the
        # scales' quotients are taken on integers (lp_jax.numerics.division); interpreted,
        # by the division of the platform the interpreter runs on.
        with integer_division() if params is None else contextlib.nullcontext():
            if by_ref:
                compute((a, i, j), *in_s, *out_s)
            else:
                tiles = compute((a, i, j), *(s if blk is None else s[...] for s, blk in zip(in_s, in_blocks)))
                for s, t in zip(out_s, tiles):
                    s[...] = t
        plgpu.commit_smem()
        for g, s, blk in zip(out_g, out_s, out_blocks):
            plgpu.copy_smem_to_gmem(s, blk.window(g, a, i, j))
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(shape, x.dtype, transforms=b.transforms if b is not None else ())
               for shape, x, b in zip(in_shapes, inputs, in_blocks)]
    scratch += [plgpu.SMEM(b.shape, t.dtype, transforms=b.transforms) for t, b in zip(out_types, out_blocks)]
    scratch.append(plgpu.Barrier(num_arrivals=1))
    kernel = plgpu.kernel(body, out_type=list(out_types), scratch_types=scratch, grid=grid,
                          grid_names=GRID_NAMES, compiler_params=plgpu.CompilerParams(**COMPILER_PARAMS),
                          interpret=params)
    return kernel(*inputs)


def _pad_lanes(x):
    """A small 1-D input zero-padded to SMEM_LANES elements (kernels read its first ones)."""
    if x.ndim != 1 or x.size > SMEM_LANES:
        raise ValueError(f"a WHOLE kernel input is a vector of at most {SMEM_LANES} scalars, got shape {x.shape}")
    return x if x.size == SMEM_LANES else jnp.pad(x, (0, SMEM_LANES - x.size))


def swizzled(itemsize: int, row_bytes: int) -> tuple:
    """SMEM transforms for a tile read or written in slices of ``row_bytes`` bytes per row:
    8-row tiles that wide, swizzled over that many bytes."""
    return (plgpu.TilingTransform((8, row_bytes // itemsize)), plgpu.SwizzleTransform(row_bytes))
