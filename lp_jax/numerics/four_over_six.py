"""NVFP4 with 4/6 block scales (Four Over Six; Transformer Engine's ``nvfp4_4over6``):
each 16-element block (or 16x16 tile) is scaled so its amax maps to 6 or to 4, whichever
reconstructs it with the smaller error (docs/numerics.md, "NVFP4 with 4/6 block scales").

The tensor scale maps the amax to 6 x 256 instead of 6 x 448, leaving E4M3 room for the
1.5x larger scale of the "4" candidate. Both candidates are encoded, each block's error is
summed in the contract's order (16 elements in order; a tile's 16 row sums pairwise), and
the "4" candidate wins only when strictly better. The choice is made with nearest
rounding; stochastic rounding, where asked for, then encodes with the chosen scale, so the
choice never depends on the random bits.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics.division import div

BOUND = 256  # the tensor scale maps amax to 6 x BOUND
DENOM = np.float32(6 * BOUND)  # 1536, exact
INV_DENOM = np.float32(1) / DENOM  # fl(1 / 1536), the decode's constant
METRICS = ("mae", "mse")
BLOCK = 16


def tensor_scale(amax):
    """S_enc = min(1536 / amax, FLT_MAX) in float32; 1 if amax is 0 or not finite."""
    amax = amax.astype(jnp.float32)
    s_enc = jnp.minimum(div(DENOM, amax), jnp.float32(F.FLT_MAX))
    bad = (amax == 0) | ~jnp.isfinite(amax) | (s_enc == 0)
    return jnp.where(bad, jnp.float32(1), s_enc)


def _in_order(d):
    """Sum over the last axis, element 0 first, each addition rounded (no reassociation)."""
    acc = d[..., 0]
    for i in range(1, d.shape[-1]):
        acc = acc + d[..., i]
    return acc


def _tile_error(d):
    """d [..., R, 16, C, 16]: each row's sum in order, then rows r and r + 8, + 4, + 2, + 1
    (a GPU warp's pairwise reduction): [..., R, C]."""
    rows = _in_order(d)  # [..., R, 16, C]
    half = BLOCK // 2
    while half:
        rows = rows[..., :half, :] + rows[..., half:2 * half, :]
        half //= 2
    return rows[..., 0, :]


def choose_scales(xb, amax_b, amax_t, tiles: bool, metric: str = "mae"):
    """(E4M3 block scales s_b, float32 encode factors enc) per block of xb.

    xb: float32 or bf16 [..., n, 16] (1-D blocks, amax_b [..., n]) or [..., R, 16, C, 16]
    (tiles, amax_b [..., R, C]); amax_t the tensor amax. The encode factor is the chosen
    candidate's min(1 / (s * S_dec), FLT_MAX)."""
    expand = (lambda a: a[..., :, None, :, None]) if tiles else (lambda a: a[..., None])
    x = xb.astype(jnp.float32)
    amax_t = amax_t.astype(jnp.float32)
    s_enc = tensor_scale(amax_t)
    s_dec = F.recip(s_enc)
    base = div(amax_b.astype(jnp.float32), np.float32(6)) * s_enc
    s6 = F.cast_satfinite(jnp.minimum(base, np.float32(F.E4M3_MAX)), F.E4M3)
    s4 = F.cast_satfinite(jnp.minimum(np.float32(1.5) * base, np.float32(F.E4M3_MAX)), F.E4M3)
    # Materialized per block: the E4M3 rounding must survive (excess precision on GPU would
    # drop the f32 -> e4m3 -> f32 round trip), and each block's integer work is done once.
    s6, s4 = lax.optimization_barrier((s6, s4))
    out = []
    for s in (s6, s4):
        sv = s.astype(jnp.float32)
        enc = lax.optimization_barrier(F.nvfp4_encode_factor(sv, s_dec))
        # NVFP4's encoding (quantize.nvfp4_encode_values) of the candidate, nearest
        q = F.e2m1_round_values(jnp.clip(x * expand(enc), -F.E2M1_MAX, F.E2M1_MAX))
        val = div((q * expand(sv)) * amax_t, DENOM)
        diff = val - x
        d = jnp.abs(diff) if metric == "mae" else diff * diff
        out.append((s, enc, _tile_error(d) if tiles else _in_order(d)))
    (s6, enc6, err6), (s4, enc4, err4) = out
    four = err4 < err6  # strictly better; ties and NaN keep 6
    return jnp.where(four, s4, s6), jnp.where(four, enc4, enc6)


def global_scale(amax_t):
    """The tensor factor the GEMM applies to its FP32 result: fl(amax * fl(1 / 1536))."""
    return amax_t.astype(jnp.float32) * INV_DENOM


def dequantize_factors(s_b, amax_t):
    """Per block (s * amax) * fl(1 / 1536): the decode multiplies each code by it."""
    return (s_b.astype(jnp.float32) * amax_t.astype(jnp.float32)) * INV_DENOM
