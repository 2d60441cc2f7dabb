"""The 16-point random Hadamard transform (RHT) that NVFP4 applies to wgrad operands.

H = (1/4) diag(s) H16, with H16 the Sylvester Hadamard matrix and a fixed sign vector s,
built in float32 and cast to bf16 (its entries +-1/4 are exact there). It is orthogonal,
so applying it to both wgrad operands along the token axis M leaves dy^T x unchanged up to
rounding, while spreading outliers across each 16-element block before FP4 quantization.
One fixed matrix for all layers and steps, as TE does.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

RHT_SIZE = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rht_matrix() -> jnp.ndarray:
    """The 16x16 bf16 matrix H; a tile v becomes v @ H."""
    h = np.diag(np.asarray(RHT_SIGNS, np.float32)) @ _sylvester(RHT_SIZE) * np.float32(0.25)
    return jnp.asarray(h, jnp.float32).astype(jnp.bfloat16)


def hadamard(x, axis=-1):
    """Applies the RHT to each 16-element tile of ``x`` along ``axis``; returns bf16.

    The length along ``axis`` must be a multiple of 16 (the transform mixes a tile's
    elements, so padding could not be dropped afterwards; the GEMM pads its operands itself).
    Pallas kernels apply the same operations elementwise (``rht_parts``).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {x.ndim}")
    n = x.shape[axis]
    if n % RHT_SIZE:
        raise ValueError(f"the length along axis={axis} must be a multiple of {RHT_SIZE} for the "
                         f"Hadamard transform, got {n} (zero-pad it: padding is exact)")
    if axis % x.ndim == x.ndim - 1:
        tiles = x.reshape(x.shape[:-1] + (n // RHT_SIZE, RHT_SIZE))
        # float32 accumulation of +-x/4 terms, then one rounding to bf16 (TE rounds the RHT output).
        out = jnp.einsum("...ti,ij->...tj", tiles, rht_matrix().astype(tiles.dtype),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return out.reshape(x.shape).astype(jnp.bfloat16)
    return _fast_walsh_hadamard(x, axis % x.ndim)


# Bit i set: sign i of RHT_SIGNS is -1. The signs are built from it with iota, not held as an
# array constant, so the transform also runs inside a Pallas kernel (which takes no array
# constants); +-1 either way, the same bits.
_NEGATIVE_SIGNS = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)


def _signs(shape):
    """RHT_SIGNS in float32, laid out in ``shape`` (16 elements, in order, plus unit axes)."""
    i = lax.iota(jnp.int32, RHT_SIZE).reshape(shape)
    return jnp.where((jnp.int32(_NEGATIVE_SIGNS) >> i) & 1 == 1, jnp.float32(-1), jnp.float32(1))


def _fast_walsh_hadamard(x, axis):
    """The same transform along a non-minor axis, without transposing: H16 = H2 (x) H2 (x) H2
    (x) H2, so four butterfly stages (a+b, a-b) over the tile's four index bits, in float32.

    A matmul along a non-minor axis makes XLA transpose the whole tensor twice. Each output
    is a sum of 16 terms +-x/4 either way; tests check the bits agree.

    Each stage pairs an element with its partner read through ``lax.rev`` of the pair axis
    (a + b where the bit is 0, a - b where it is 1: the same two float32 operations as
    slicing and concatenating), which XLA fuses into one pass; slices and concatenates
    would cost one float32 pass over the tensor per stage.
    """
    n = x.shape[axis]
    v = x.astype(jnp.float32).reshape(x.shape[:axis] + (n // RHT_SIZE, 2, 2, 2, 2) + x.shape[axis + 1:])
    v = v * _signs((2, 2, 2, 2) + (1,) * (x.ndim - 1 - axis))
    for bit in range(4):
        ax = axis + 1 + bit
        partner = lax.rev(v, (ax,))
        v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, ax) == 0, v + partner, partner - v)
    return (v * np.float32(0.25)).reshape(x.shape).astype(jnp.bfloat16)


def rht_parts(parts):
    """The RHT of 16 float32 arrays holding the 16 positions of each tile along the transformed
    axis, as 16 bf16 arrays: ``_fast_walsh_hadamard``'s operations in its order (signs, then
    butterflies over index bits 8, 4, 2, 1, then x 1/4), elementwise, so the bits are its bits.
    A Pallas kernel applies it to the 16 strided views of an SMEM tile (no reshape, concatenate
    or iota, which Mosaic GPU does not lower in that layout)."""
    if len(parts) != RHT_SIZE:
        raise ValueError(f"rht_parts takes {RHT_SIZE} arrays, got {len(parts)}")
    v = [p * np.float32(s) for p, s in zip(parts, RHT_SIGNS)]
    for stride in (8, 4, 2, 1):
        for k in range(RHT_SIZE):
            if not k & stride:
                v[k], v[k + stride] = v[k] + v[k + stride], v[k] - v[k + stride]
    return [(p * np.float32(0.25)).astype(jnp.bfloat16) for p in v]
