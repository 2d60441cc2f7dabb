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


def hadamard(x, axis=-1, *, in_kernel=False):
    """Applies the RHT to each 16-element tile of ``x`` along ``axis``; returns bf16.

    The length along ``axis`` must be a multiple of 16 (the transform mixes a tile's
    elements, so padding could not be dropped afterwards; the GEMM pads its operands itself).
    ``in_kernel``: called inside a Pallas kernel (the butterfly in the ops kernels lower).
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
    return _fast_walsh_hadamard(x, axis % x.ndim, fused=not in_kernel)


# Bit i set: sign i of RHT_SIGNS is -1. The signs are built from it with iota, not held as an
# array constant, so the transform also runs inside a Pallas kernel (which takes no array
# constants); +-1 either way, the same bits.
_NEGATIVE_SIGNS = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)


def _signs(shape):
    """RHT_SIGNS in float32, laid out in ``shape`` (16 elements, in order, plus unit axes)."""
    i = lax.iota(jnp.int32, RHT_SIZE).reshape(shape)
    return jnp.where((jnp.int32(_NEGATIVE_SIGNS) >> i) & 1 == 1, jnp.float32(-1), jnp.float32(1))


def _fast_walsh_hadamard(x, axis, fused=True):
    """The same transform along a non-minor axis, without transposing: H16 = H2 (x) H2 (x) H2
    (x) H2, so four butterfly stages (a+b, a-b) over the tile's four index bits, in float32.

    A matmul along a non-minor axis makes XLA transpose the whole tensor twice (6x slower on
    CPU). Each output is a sum of 16 terms +-x/4 either way; tests check the bits agree.

    ``fused``: each stage pairs an element with its partner read through ``lax.rev`` of the
    pair axis (a + b where the bit is 0, a - b where it is 1: the same two float32 operations
    as slicing and concatenating), which XLA fuses into one pass; the concatenates cost one
    float32 pass over the tensor per stage (XLA:CPU: 4.6 against 8.1 ms for 2048x1536).
    Without it, the slice-and-concatenate form (what Pallas kernels lower).
    """
    n = x.shape[axis]
    v = x.astype(jnp.float32).reshape(x.shape[:axis] + (n // RHT_SIZE, 2, 2, 2, 2) + x.shape[axis + 1:])
    v = v * _signs((2, 2, 2, 2) + (1,) * (x.ndim - 1 - axis))
    for bit in range(4):
        ax = axis + 1 + bit
        if fused:
            partner = lax.rev(v, (ax,))
            v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, ax) == 0, v + partner, partner - v)
            continue
        a = lax.index_in_dim(v, 0, ax, keepdims=True)
        b = lax.index_in_dim(v, 1, ax, keepdims=True)
        v = jnp.concatenate([a + b, a - b], axis=ax)
    return (v * np.float32(0.25)).reshape(x.shape).astype(jnp.bfloat16)
