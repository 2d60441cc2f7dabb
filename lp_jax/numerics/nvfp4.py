"""NVFP4: E2M1 values in 16-element blocks (or 16x16 tiles for weights), each with an E4M3
block scale, under an FP32 tensor scale that keeps the E4M3 scales in range; stochastic
rounding where asked; 4/6 block scales as a variant (``numerics.four_over_six``;
docs/numerics.md)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics import four_over_six
from lp_jax.numerics import gradual_underflow as G
from lp_jax.numerics.blocks import (
    abs_max,
    block_amax,
    from_blocks,
    from_tiles,
    per_element,
    to_blocks,
    to_blocks_in_place,
    to_tiles,
    unblocked,
)
from lp_jax.numerics.division import div
from lp_jax.numerics.format import Format, FormatVariant
from lp_jax.numerics.quantized_tensor import QuantizedTensor

NVFP4_BLOCK = 16
NVFP4_TENSOR_SCALE_NUM = F.E2M1_MAX * F.E4M3_MAX  # 2688: amax_t maps to 6 x 448
# NumPy, not jnp: a jnp computation at import time would start the XLA backend, and
# jax.distributed.initialize (multi-host runs) must come before that.
INV_E2M1_MAX = np.float32(1) / np.float32(6)


def nvfp4_tensor_scale(amax):
    """NVFP4 S_enc = 2688 / amax (float32), clamped to FLT_MAX; 1 if amax is 0/not finite."""
    amax = amax.astype(jnp.float32)
    s_enc = jnp.minimum(div(jnp.float32(NVFP4_TENSOR_SCALE_NUM), amax), jnp.float32(F.FLT_MAX))
    # isnan | isinf rather than ~isfinite: the same test, and one Mosaic GPU lowers (the
    # Pallas kernels compute S_enc from the amax themselves).
    bad = (amax == 0) | jnp.isnan(amax) | jnp.isinf(amax) | (s_enc == 0)
    return jnp.where(bad, jnp.float32(1), s_enc)


def nvfp4_block_scales(amax_b, s_enc, barrier=True):
    """s_b = cast_satfinite_e4m3(amax_b * (S_enc * fp32(1/6))), the product formed first.

    Every user widens s_b back to FP32 (for enc_b, for q * s_b): without the barrier, XLA's
    GPU pass that drops f32 -> fp8 -> f32 chains as excess precision would skip the E4M3
    rounding of the block scales. A no-op on CPU; per block, so it costs little. A Pallas
    kernel passes barrier=False: Mosaic GPU rounds as written, and has no barrier rule for
    8-bit values held one per thread (``NotImplementedError: 1``).
    """
    s_b = F.cast_satfinite(amax_b * (s_enc * INV_E2M1_MAX), F.E4M3)
    return lax.optimization_barrier(s_b) if barrier else s_b


def _nvfp4_scaled(x, enc):
    return jnp.clip(x * enc, -F.E2M1_MAX, F.E2M1_MAX)


def nvfp4_encode(x, enc, rounding="nearest", key=None):
    """E2M1 data of x given its per-block encode factors ``enc`` (broadcastable to x)."""
    return F.e2m1_round(_nvfp4_scaled(x, enc), rounding, key)


def nvfp4_encode_codes(x, enc, rounding="nearest", key=None):
    """``nvfp4_encode``'s 4-bit codes as uint32 (what a Pallas kernel packs two per byte)."""
    return F.e2m1_codes(_nvfp4_scaled(x, enc), rounding, key)


def nvfp4_encode_values(x, enc, rounding="nearest", key=None):
    """The float32 values of ``nvfp4_encode(x, enc, ...)``, with no fp4 convert (for GEMM
    operands that are decoded at once: ``lp_jax.numerics.decoded``)."""
    return F.e2m1_round_values(_nvfp4_scaled(x, enc), rounding, key)


def nvfp4_block_encoding(amax_b, s_enc, barrier=True):
    """(E4M3 block scales s_b, float32 encode factors enc_b), one per block.

    The barrier materializes enc_b per block: fused into the elementwise pass, XLA would
    redo its exact integer arithmetic for every element. A Pallas kernel computes each
    block's factor once anyway and passes barrier=False (same bits).
    """
    s_b = nvfp4_block_scales(amax_b, s_enc, barrier)
    enc = F.nvfp4_encode_factor(s_b.astype(jnp.float32), F.recip(s_enc))
    return s_b, lax.optimization_barrier(enc) if barrier else enc


def nvfp4_blocks(xb, s_enc, rounding="nearest", key=None, amax=None):
    """xb: float32 or bf16 [..., n, 16]; amax as for ``mxfp8_blocks``. Returns (E2M1 data,
    E4M3 block scales [..., n])."""
    s_b, enc = nvfp4_block_encoding(abs_max(xb, axis=-1) if amax is None else amax, s_enc)
    return nvfp4_encode(xb, enc[..., None], rounding, key), s_b


def nvfp4_tiles(xt, s_enc, rounding="nearest", key=None):
    """xt: float32 [..., R, 16, C, 16] (16x16 tiles). Returns (E2M1 data, E4M3 [..., R, C])."""
    s_b, enc = nvfp4_block_encoding(abs_max(xt, axis=(-3, -1)), s_enc)
    return nvfp4_encode(xt, enc[..., :, None, :, None], rounding, key), s_b


def quantize_4over6(xf, axis, block_2d, rounding, key, metric, amax_t) -> QuantizedTensor:
    amax_t = amax_t.astype(jnp.float32)
    g = four_over_six.global_scale(amax_t)
    if block_2d:
        r, c = xf.shape[-2:]
        xt = to_tiles(xf, NVFP4_BLOCK)
        s_b, enc = four_over_six.choose_scales(xt, abs_max(xt, axis=(-3, -1)), amax_t, True, metric)
        data = from_tiles(four_over_six.encode(xt, enc[..., :, None, :, None], rounding, key), r, c)
        return QuantizedTensor(data, s_b, g, NVFP4_FORMAT.name, xf.ndim - 1, True, amax_t)
    xb = to_blocks(xf, axis, NVFP4_BLOCK)
    s_b, enc = four_over_six.choose_scales(xb, block_amax(xf, axis, NVFP4_BLOCK), amax_t, False, metric)
    data = from_blocks(four_over_six.encode(xb, enc[..., None], rounding, key), axis, xf.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(s_b, -1, axis), g, NVFP4_FORMAT.name, axis, False, amax_t)


def nvfp4_values(t, axis, block_2d=False, rounding="nearest", key=None):
    s_enc = nvfp4_tensor_scale(abs_max(t))
    if block_2d:
        xt = to_tiles(t, NVFP4_BLOCK)
        s_b, enc = nvfp4_block_encoding(abs_max(xt, axis=(-3, -1)), s_enc)
        q = nvfp4_encode_values(xt, enc[..., :, None, :, None], rounding, key)
        values = from_tiles(q * s_b.astype(jnp.float32)[..., :, None, :, None], *t.shape[-2:])
        values = jnp.moveaxis(values, axis, -1)
    else:
        xb = to_blocks(t, axis, NVFP4_BLOCK)
        s_b, enc = nvfp4_block_encoding(block_amax(t, axis, NVFP4_BLOCK), s_enc)
        q = nvfp4_encode_values(xb, enc[..., None], rounding, key)
        values = unblocked(q * s_b.astype(jnp.float32)[..., None], t.shape[axis])
    return values, F.recip(s_enc)


def nvfp4_values_in_place(t, rounding="nearest", key=None):
    """``nvfp4_values(t, 0, ...)`` for 2-D t, with 1-D blocks along axis 0, laid out as t is
    (blocks down the columns) instead of with that axis moved last: the same values,
    transposed, without the transposed pass over t, for a GEMM that reads its operand
    contracting the first axis. Stochastic rounding draws each element's bits by its place
    in the moved layout, as ``nvfp4_values`` does, so the rounding is the same bit for bit."""
    m, n = t.shape
    s_enc = nvfp4_tensor_scale(abs_max(t))
    xb = to_blocks_in_place(t, NVFP4_BLOCK)
    mp = xb.shape[0] * NVFP4_BLOCK
    s_b, enc = nvfp4_block_encoding(abs_max(xb, axis=1), s_enc)

    def noise(shape):  # shape [blocks, 16, n]: element (b, i, c) is (c, b, i) of the moved layout
        at = lambda d: lax.broadcasted_iota(jnp.uint32, shape, d)  # noqa: E731
        return F.uniform_from_index(F.sr_seeds(key), at(2) * jnp.uint32(mp) + at(0) * jnp.uint32(NVFP4_BLOCK) + at(1))

    q = nvfp4_encode_values(xb, enc[:, None, :], rounding, noise if rounding == "stochastic" else None)
    values = (q * s_b.astype(jnp.float32)[:, None, :]).reshape(mp, n)[:m]
    return values, F.recip(s_enc)


def _quantize(xf, axis, block_2d, rounding, key, amax_t):
    s_enc = nvfp4_tensor_scale(amax_t)
    s_dec = F.recip(s_enc)  # may be a float32 subnormal: kept as bits, applied by F.mul
    if block_2d:
        r, c = xf.shape[-2:]
        data_t, s_b = nvfp4_tiles(to_tiles(xf, NVFP4_BLOCK), s_enc, rounding, key)
        return QuantizedTensor(from_tiles(data_t, r, c), s_b, s_dec, NVFP4_FORMAT.name, xf.ndim - 1, True)
    data_b, s_b = nvfp4_blocks(to_blocks(xf, axis, NVFP4_BLOCK), s_enc, rounding, key,
                               block_amax(xf, axis, NVFP4_BLOCK))
    data = from_blocks(data_b, axis, xf.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(s_b, -1, axis), s_dec, NVFP4_FORMAT.name, axis)


@dataclasses.dataclass(frozen=True)
class NVFP4(Format):
    scheme = "nvfp4"
    decodes_in_place = True

    def quantize(self, xf, axis, *, block_2d=False, rounding="nearest", key=None, tensor_amax=None,
                 block_scale_search=None, metric="mae", **_):
        amax_t = abs_max(xf) if tensor_amax is None else tensor_amax
        if block_scale_search:  # the one variant, 4/6 block scales
            return quantize_4over6(xf, axis, block_2d, rounding, key, metric, amax_t)
        return _quantize(xf, axis, block_2d, rounding, key, amax_t)

    def block_values(self, q):
        """q * s_b, exact in bf16."""
        return q.data.astype(jnp.float32) * per_element(q, NVFP4_BLOCK)

    def dequantize(self, q):
        if q.tensor_amax is not None:  # 4/6 block scales: code x ((s x amax) x fl(1/1536))
            factors = four_over_six.dequantize_factors(q.scale, q.tensor_amax)
            return G.mul(q.data.astype(jnp.float32), per_element(q, NVFP4_BLOCK, factors))
        return super().dequantize(q)

    def values(self, t, axis, *, block_2d=False, rounding="nearest", key=None, block_scale_search=None,
               metric="mae", **_):
        if block_scale_search:  # 4/6: its values over the tensor factor the GEMM applies
            q = self.quantize(F.exact_f32(t), axis % t.ndim, block_2d=block_2d, rounding=rounding, key=key,
                              block_scale_search=block_scale_search, metric=metric)
            q = dataclasses.replace(q, data=lax.optimization_barrier(q.data))
            return jnp.moveaxis(self.block_values(q), axis, -1), q.global_scale
        return nvfp4_values(t, axis, block_2d, rounding, key)

    def values_in_place(self, t, rounding="nearest", key=None):
        return nvfp4_values_in_place(t, rounding, key)


# Each block (or tile) scaled to 6 or to 4, whichever reconstructs it better; XLA only.
FOUR_OVER_SIX = FormatVariant(option="4over6", name="nvfp4_4over6", label="NVFP4 4/6")
NVFP4_FORMAT = NVFP4(name="nvfp4", label="NVFP4", color="tab:red", element=F.E2M1, block=NVFP4_BLOCK,
                     scale=F.E4M3, tensor_scale=True, tiles=True, stochastic=True, variants=(FOUR_OVER_SIX,),
                     pallas=True, auto_pallas=True, gemm="cudnn")
