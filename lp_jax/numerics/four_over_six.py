"""NVFP4 with 4/6 block scales (Four Over Six; Transformer Engine's ``nvfp4_4over6``):
each 16-element block (or 16x16 tile) is scaled so its amax maps to 6 or to 4, whichever
reconstructs it with the smaller error (docs/numerics.md, "NVFP4 with 4/6 block scales").

The tensor scale maps the amax to 6 x 256 instead of 6 x 448, leaving E4M3 room for the
1.5x larger scale of the "4" candidate. Both candidates are encoded, each block's error is
summed in the contract's order (16 elements in order; a tile's 16 row sums pairwise), and
the "4" candidate wins only when strictly better. The choice is made with nearest
rounding; stochastic rounding, where asked for, then encodes with the chosen scale, so the
choice never depends on the random bits. Every product, quotient and sum that may meet a
float32 subnormal (a tiny tensor's, or a subnormal element's) is IEEE's with gradual
underflow (``gradual_underflow``), also on CPU, which flushes subnormals.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics import gradual_underflow as G
from lp_jax.numerics.division import div

BOUND = 256  # the tensor scale maps amax to 6 x BOUND
DENOM = np.float32(6 * BOUND)  # 1536, exact
INV_DENOM = np.float32(1) / DENOM  # fl(1 / 1536), the decode's constant
METRICS = ("mae", "mse")
BLOCK = 16


def tensor_scale(amax):
    """S_enc = min(1536 / amax, FLT_MAX) in float32; 1 if amax is 0 or not finite."""
    amax = amax.astype(jnp.float32)
    s_enc = jnp.minimum(div(DENOM, amax), jnp.float32(F.FLT_MAX))  # a subnormal amax overflows it
    zero = (F.f32_bits(amax) & 0x7FFFFFFF) == 0  # bits: CPU compares a subnormal amax equal to 0
    bad = zero | ~jnp.isfinite(amax) | (s_enc == 0)
    return jnp.where(bad, jnp.float32(1), s_enc)


def _in_order(d):
    """Sum over the last axis, element 0 first, each addition rounded (no reassociation)."""
    return lax.platform_dependent(d, default=_in_order_on_integers, cuda=_in_order_unrolled)


def _in_order_unrolled(d):
    acc = d[..., 0]
    for i in range(1, d.shape[-1]):
        acc = acc + d[..., i]
    return acc


def _in_order_on_integers(d):
    """``G.ieee_add`` in a loop: one copy of its integer work to compile, not one per element."""
    def step(i, acc):
        return G.ieee_add(acc, lax.dynamic_index_in_dim(d, i, axis=d.ndim - 1, keepdims=False))
    return lax.fori_loop(1, d.shape[-1], step, d[..., 0])


def _tile_error(d):
    """d [..., R, 16, C, 16]: each row's sum in order, then rows r and r + 8, + 4, + 2, + 1
    (a GPU warp's pairwise reduction): [..., R, C]."""
    rows = _in_order(d)  # [..., R, 16, C]
    half = BLOCK // 2
    while half:
        rows = G.add(rows[..., :half, :], rows[..., half:2 * half, :])
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
    base = G.mul(G.div(amax_b, np.float32(6)), s_enc)
    s6 = F.cast_satfinite(jnp.minimum(base, np.float32(F.E4M3_MAX)), F.E4M3)
    s4 = F.cast_satfinite(jnp.minimum(np.float32(1.5) * base, np.float32(F.E4M3_MAX)), F.E4M3)
    # Materialized per block: the E4M3 rounding must survive (excess precision on GPU would
    # drop the f32 -> e4m3 -> f32 round trip), and each block's integer work is done once.
    s6, s4 = lax.optimization_barrier((s6, s4))
    # Both candidates at once, stacked on a leading axis: one copy of the arithmetic to
    # compile (on CPU its integer form is long).
    sv = jnp.stack([s6, s4]).astype(jnp.float32)
    enc = lax.optimization_barrier(F.nvfp4_encode_factor(sv, s_dec))
    # NVFP4's encoding of each candidate, nearest; q * s is exact (both at least 2^-10)
    q = F.e2m1_round_values(scaled(x, expand(enc)))
    val = G.div(G.mul(q * expand(sv), amax_t), DENOM)
    diff = G.sub(val, x)
    d = G.magnitude(diff) if metric == "mae" else G.mul(diff, diff)
    err6, err4 = _tile_error(d) if tiles else _in_order(d)
    four = G.less_non_negative(err4, err6)  # strictly better; ties and NaN keep 6
    enc6, enc4 = enc
    return jnp.where(four, s4, s6), jnp.where(four, enc4, enc6)


def scaled(x, enc):
    """clip(x * enc, -6, 6): what a block's codes round, x * enc exact for a subnormal x too
    (a tiny block's encode factor can reach FLT_MAX)."""
    return jnp.clip(G.mul(x, enc), -F.E2M1_MAX, F.E2M1_MAX)


def encode(x, enc, rounding="nearest", key=None):
    """The E2M1 codes of x with its blocks' chosen encode factors ``enc`` (broadcast to x)."""
    return F.e2m1_round(scaled(x, enc), rounding, key)


def global_scale(amax_t):
    """The tensor factor the GEMM applies to its FP32 result: fl(amax * fl(1 / 1536))."""
    return G.mul(amax_t, INV_DENOM)


def dequantize_factors(s_b, amax_t):
    """Per block (s * amax) * fl(1 / 1536): the decode multiplies each code by it."""
    return G.mul(G.mul(s_b.astype(jnp.float32), amax_t), INV_DENOM)
