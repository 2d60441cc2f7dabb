"""Independent NumPy transcription of NVFP4 with 4/6 block scales (docs/numerics.md, "NVFP4
with 4/6 block scales"), the test oracle for ``block_scale_search="4over6"``.

Written from the contract alone, in the style of tests/support/numpy_reference.py: every
FP32 step in np.float32 (gradual underflow), element and scale rounding on the formats'
grids, sums in the contract's order.
"""
from __future__ import annotations

import numpy as np

from tests.support.numpy_reference import (
    _ERRSTATE,
    F32,
    FLT_MAX,
    NV_BLOCK,
    RefQuantized,
    _amax,
    _as_f32,
    _blocks,
    _per_element,
    _tiles,
    _tiles_per_element,
)
from tests.support.numpy_reference_casts import E2M1, E4M3, cast_satfinite, decode

BOUND = F32(256)  # the tensor scale maps amax to 6 x 256, not 6 x 448
DENOM = F32(6) * BOUND  # 1536, exact


def tensor_scales(amax_t) -> tuple[np.float32, np.float32]:
    """(S_enc, S_dec): S_enc = min(1536 / amax, FLT_MAX); 1 when amax is 0 or not finite."""
    amax_t = F32(amax_t)
    with np.errstate(**_ERRSTATE):
        s_enc = min(DENOM / amax_t, F32(FLT_MAX))
        if amax_t == 0 or not np.isfinite(amax_t) or s_enc == 0:
            s_enc = F32(1)
        return F32(s_enc), F32(1) / F32(s_enc)


def _sequential_sum(d: np.ndarray) -> np.ndarray:
    """Sum over the last axis in order 0..n-1, each addition rounded to FP32."""
    acc = np.zeros(d.shape[:-1], np.float32)
    for i in range(d.shape[-1]):
        acc = (acc + d[..., i]).astype(np.float32)
    return acc


def _tile_sum(d: np.ndarray) -> np.ndarray:
    """d (..., R, 16, C, 16): each row's sum in order, then rows r and r + 8, + 4, + 2, + 1."""
    rows = _sequential_sum(d)  # (..., R, 16, C)
    half = NV_BLOCK // 2
    while half:
        rows = (rows[..., :half, :] + rows[..., half:2 * half, :]).astype(np.float32)
        half //= 2
    return rows[..., 0, :]


def quantize_nvfp4_4over6(x, axis: int = -1, block_2d: bool = False, metric: str = "mae") -> RefQuantized:
    t = _as_f32(x)
    amax_t = F32(_amax(t, axis=None))
    s_enc, s_dec = tensor_scales(amax_t)
    if block_2d:
        blocks = _tiles(t)
        amax_b = _amax(blocks, axis=(-3, -1))
        expand = lambda a: a[..., :, None, :, None]  # noqa: E731
        r, c = t.shape[-2:]

        def unblocked(a):
            return a.reshape(a.shape[:-4] + (a.shape[-4] * 16, a.shape[-2] * 16))[..., :r, :c]
    else:
        blocks = _blocks(t, axis, NV_BLOCK)
        amax_b = _amax(blocks, axis=-1)
        expand = lambda a: a[..., None]  # noqa: E731

        def unblocked(a):
            return np.moveaxis(a.reshape(a.shape[:-2] + (-1,))[..., : t.shape[axis]], -1, axis)
    with np.errstate(**_ERRSTATE):
        base = ((amax_b / F32(6)).astype(np.float32) * s_enc).astype(np.float32)
        candidates = {6: cast_satfinite(np.minimum(base, F32(448)), E4M3),
                      4: cast_satfinite(np.minimum((F32(1.5) * base).astype(np.float32), F32(448)), E4M3)}
        codes, errors, scaled = {}, {}, {}
        for k, s in candidates.items():
            sv = decode(s, E4M3).astype(np.float32)
            inv = np.minimum(F32(1) / (sv * s_dec).astype(np.float32), F32(FLT_MAX)).astype(np.float32)
            scaled[k] = np.clip((blocks * expand(inv)).astype(np.float32), F32(-6), F32(6))
            codes[k] = cast_satfinite(scaled[k], E2M1)
            q = decode(codes[k], E2M1).astype(np.float32)
            val = ((q * expand(sv)).astype(np.float32) * amax_t).astype(np.float32)
            val = (val / DENOM).astype(np.float32)
            diff = (val - blocks).astype(np.float32)
            d = np.abs(diff) if metric == "mae" else (diff * diff).astype(np.float32)
            errors[k] = _tile_sum(d) if block_2d else _sequential_sum(d)
        four = errors[4] < errors[6]  # strictly smaller; ties and NaN keep 6
        s_b = np.where(four, candidates[4], candidates[6]).astype(np.uint8)
        data = unblocked(np.where(expand(four), codes[4], codes[6]).astype(np.uint8))
        # E2M1 has no NaN: a NaN scaled value (a NaN element, or its block's) leaves the code unspecified
        known = ~np.isnan(unblocked(np.where(expand(four), scaled[4], scaled[6])))
        sv = decode(s_b, E4M3).astype(np.float32)
        # dequantize: code * ((s * amax) * fl(1 / 1536))
        factor = ((sv * amax_t).astype(np.float32) * (F32(1) / DENOM)).astype(np.float32)
        if block_2d:
            fac_el = _tiles_per_element(factor, t.shape)
        else:
            fac_el = _per_element(factor, t.shape, axis, NV_BLOCK)
            s_b, sv = np.moveaxis(s_b, -1, axis % t.ndim), np.moveaxis(sv, -1, axis % t.ndim)
        deq = (decode(data, E2M1).astype(np.float32) * fac_el).astype(np.float32)
        deq = np.where(known, deq, np.float32(np.nan)).astype(np.float32)
    return RefQuantized("nvfp4", data, known, s_b, sv, F32(amax_t), deq)
