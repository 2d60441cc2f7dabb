"""Strided SMEM views: how the NVFP4 kernels (and MXFP8's untransposed column copy) reduce
blocks in a form Mosaic GPU lowers for CUDA.

Mosaic GPU reduces an array in its strided layout only to a scalar and cannot reshape or
slice it, but it loads and stores a reshaped, transposed and indexed SMEM ref (a strided
memref) in that layout. A tile is therefore read as one view per position within a block
(``ref.reshape(tr, tc // b, b).at[rows, :, k]``), each view holding that position of many
blocks, and a block's amax is an elementwise max over the views. A store through a strided
view is valid only at one element per thread, so every view a kernel stores is exactly
``LANES`` elements (docs/backends.md).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax.kernels.launch import interpret_params

LANES = 128  # a warpgroup: a stored view holds one element per thread


@dataclasses.dataclass
class Tile:
    """An SMEM tile read and written through strided views ``view(shape, perm, idx)``: the
    tile reshaped to ``shape``, its axes permuted by ``perm`` (or not), indexed by ``idx``.

    Compiled, the views are SMEM refs (Mosaic GPU lowers a reshaped, transposed, indexed
    ref to a strided memref). Pallas's GPU interpreter supports neither reshaped nor
    dynamically indexed refs, so there the tile is read once as a value, viewed the same
    way, and written back once (``flush``); the arithmetic on the views is the same code
    either way.
    """

    ref: object
    interpreted: bool
    value: object = None

    def __post_init__(self):
        if self.interpreted:
            self.value = self.ref[...]

    def _ref_view(self, shape, perm, idx):
        v = self.ref if tuple(shape) == tuple(self.ref.shape) else self.ref.reshape(*shape)
        v = v if perm is None else v.transpose(perm)
        return v.at[idx]

    def load(self, shape, perm, idx):
        """The view as float32, one element per thread."""
        if self.interpreted:
            v = self.value.reshape(shape)
            v = v if perm is None else jnp.transpose(v, perm)
            return v[_static_index(idx)].astype(jnp.float32)
        view = self._ref_view(shape, perm, idx)
        return plgpu.load(view, layout=layout(view.shape)).astype(jnp.float32)

    def store(self, shape, perm, idx, x):
        if not self.interpreted:
            self._ref_view(shape, perm, idx)[...] = x
            return
        v = self.value.reshape(shape)
        v = v if perm is None else jnp.transpose(v, perm)
        # The whole view is replaced, not scattered into (a scatter of a full slice makes an
        # array constant, which a kernel may not capture).
        v = x if tuple(x.shape) == tuple(v.shape) else v.at[_static_index(idx)].set(x)
        v = v if perm is None else jnp.transpose(v, tuple(int(p) for p in np.argsort(perm)))
        self.value = v.reshape(self.ref.shape)

    def flush(self):
        if self.interpreted:
            self.ref[...] = self.value


def _static_index(idx):
    """An index of ints and pl.ds as NumPy indexing (the interpreter's loops are static)."""
    return tuple(slice(i.start, i.start + i.size) if isinstance(i, pl.Slice) else i for i in idx)


def loop(n, body, init, interpreted, start=0):
    """lax.fori_loop compiled (one copy of the body); a Python loop in the interpreter."""
    if not interpreted:
        return lax.fori_loop(start, n, body, init)
    for c in range(start, n):
        init = body(c, init)
    return init


def layout(shape):
    return plgpu.Layout.WG_STRIDED(tuple(shape), vec_size=1)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.uint32, shape, dim, layout=layout(shape))


def amax_bits(parts):
    """Elementwise max |p| over the arrays, as uint32 bits of float32 (NaN above inf)."""
    bits = [lax.bitcast_convert_type(jnp.abs(p), jnp.uint32) for p in parts]
    m = bits[0]
    for b in bits[1:]:
        m = jnp.maximum(m, b)
    return m


def as_f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def u32(v):
    return jnp.asarray(v).astype(jnp.uint32)


def is_interpreted(interpret) -> bool:
    return interpret_params(interpret) is not None
