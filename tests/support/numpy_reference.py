"""Independent NumPy transcription of the numerics contract, docs/numerics.md (the test oracle).

Written from the contract alone, without looking at lp_jax: NumPy + ml_dtypes, no JAX.
FP32 steps of the contract are done in np.float32 (IEEE, gradual underflow: NumPy never
flushes subnormals); element rounding is done exactly in float64 on the format's grid.
Codes are returned as uint8 (for E2M1 the 4-bit code in the low bits, as ml_dtypes stores
float4_e2m1fn). Comments name the rule of docs/numerics.md each step implements, with the
section's heading in brackets ([MXFP8], [NVFP4], ...).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tests.support import numpy_reference_casts as casts
from tests.support.numpy_reference_casts import E2M1, E4M3, E5M2, cast_satfinite, decode

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
_ERRSTATE = dict(over="ignore", under="ignore", divide="ignore", invalid="ignore")

MX_BLOCK, NV_BLOCK = 32, 16
E8M0_NAN = 255


@dataclasses.dataclass
class RefQuantized:
    fmt: str
    data: np.ndarray  # uint8 element codes, shape of x
    data_known: np.ndarray  # bool, shape of x: False where the contract leaves data unspecified
    scale: np.ndarray  # uint8 codes (E8M0 / E4M3 block scales), or float32 () scale_inv
    scale_factor: np.ndarray  # float32 decoded dequantization factor, shape of `scale`
    global_scale: np.float32 | None  # nvfp4 S_dec
    dequantized: np.ndarray  # float32, shape of x
    scaled: np.ndarray | None = None  # nvfp4: float32 clip(t * enc_b, -6, 6) before rounding


def _as_f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)  # bf16 -> fp32 is exact


# ---------------------------------------------------------------- block layout helpers
def _blocks(x: np.ndarray, axis: int, block: int) -> np.ndarray:
    """x with `axis` moved last, zero padded to a multiple of `block`, split (..., nb, block).
    [MXFP8, NVFP4] padding: zeros up to the next multiple (a zero never changes an amax)."""
    xm = np.moveaxis(x, axis, -1)
    pad = -xm.shape[-1] % block
    xm = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    return xm.reshape(xm.shape[:-1] + (xm.shape[-1] // block, block))


def _per_element(per_block: np.ndarray, shape, axis: int, block: int) -> np.ndarray:
    """Broadcasts a (..., nb) per-block array (blocked axis last) back to x's layout."""
    axis = axis % len(shape)
    full = np.repeat(per_block, block, axis=-1)[..., : shape[axis]]
    return np.moveaxis(full, -1, axis)


def _tiles(x: np.ndarray, tile: int = NV_BLOCK) -> np.ndarray:
    """tile x tile tiles over the last two axes: (..., R/t, t, C/t, t), zero padded."""
    pads = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % tile), (0, -x.shape[-1] % tile)]
    xp = np.pad(x, pads)
    r, c = xp.shape[-2] // tile, xp.shape[-1] // tile
    return xp.reshape(xp.shape[:-2] + (r, tile, c, tile))


def _tiles_per_element(per_tile: np.ndarray, shape, tile: int = NV_BLOCK) -> np.ndarray:
    full = np.repeat(np.repeat(per_tile, tile, axis=-2), tile, axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def _amax(a: np.ndarray, axis) -> np.ndarray:
    # [Zero, NaN, infinity and subnormals]: the plain maximum, NaN-propagating; np.max propagates NaN too.
    return np.max(np.abs(a), axis=axis)


# ---------------------------------------------------------------- FP8 per-tensor (FP8-CS)
def per_tensor_scale(amax: np.float32, fmax: float) -> np.float32:
    """[FP8 with per-tensor current scaling] scale = fmax / amax, an FP32 division rounded to nearest."""
    amax = F32(amax)
    if amax == 0 or not np.isfinite(amax):
        return F32(1)  # amax 0, inf or NaN: scale = 1
    with np.errstate(**_ERRSTATE):
        scale = F32(fmax) / amax
    return F32(FLT_MAX) if np.isinf(scale) else scale  # an overflowing division: FLT_MAX


def quantize_per_tensor(x, fmt: casts.ElementFormat) -> RefQuantized:
    t = _as_f32(x)
    amax = _amax(t, axis=None)  # amax of the whole tensor
    scale = per_tensor_scale(amax, fmt.max_value)
    with np.errstate(**_ERRSTATE):
        data = cast_satfinite(t * scale, fmt)  # q = satfinite(t * scale), the product in FP32
        scale_inv = F32(1) / scale  # decoded with scale_inv = 1 / scale
        deq = decode(data, fmt) * scale_inv
    return RefQuantized(fmt.name, data, np.ones(t.shape, bool), np.asarray(scale_inv, np.float32),
                        np.asarray(scale_inv, np.float32), None, deq)


# ---------------------------------------------------------------- MXFP8
def rceil_code(amax) -> np.ndarray:
    """E8M0 code of a block from its amax, [MXFP8] "Block scale: RCEIL"."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(**_ERRSTATE):
        d = amax * (F32(1) / F32(448))  # d = amax_block * fp32(1/448), an FP32 product
    bits = d.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int64)  # d's biased exponent
    mantissa = bits & 0x7FFFFF
    code = exponent + (mantissa != 0)  # plus one if d's mantissa bits are not all zero
    # An FP32-subnormal d (exponent field 0) with mantissa <= 0x400000 is not incremented
    # (so d <= 2^-127 gives X = 2^-127; a zero block lands here: code 0).
    code = np.where((exponent == 0) & (mantissa <= 0x400000), exponent, code)
    code = np.where(np.isinf(amax), 254, code)  # an infinite amax: code 254
    code = np.where(np.isnan(amax), E8M0_NAN, code)  # a NaN amax: code 255
    return code.astype(np.uint8)


def floor_code(amax) -> np.ndarray:
    """[MXFP8] "Block scale: FLOOR" (OCP v1.0): X = 2^(floor(log2 amax) - 8). The rule covers
    finite non-zero amax only; here zero gives 0 (like RCEIL), the rest is clamped to
    [0, 254], as docs/numerics.md completes it."""
    amax = np.asarray(amax, np.float64)
    _, e = np.frexp(np.where(np.isfinite(amax) & (amax > 0), amax, 1.0))  # floor(log2) = e - 1
    code = np.clip(e - 1 - 8 + 127, 0, 254)
    code = np.where(amax == 0, 0, code)
    code = np.where(np.isinf(amax), 254, code)
    return np.where(np.isnan(amax), E8M0_NAN, code).astype(np.uint8)


def e8m0_value(code) -> np.ndarray:
    """[Element formats] E8M0 code e stands for 2^(e-127); 255 is NaN; there is no zero
    (float32; code 0 is the subnormal 2^-127)."""
    code = np.asarray(code).astype(np.int64)
    with np.errstate(**_ERRSTATE):
        v = np.ldexp(1.0, code - 127).astype(np.float32)
    return np.where(code == E8M0_NAN, np.float32(np.nan), v)


def quantize_mxfp8(x, axis: int = -1, scale_rule: str = "rceil") -> RefQuantized:
    t = _as_f32(x)
    blocks = _blocks(t, axis, MX_BLOCK)  # [MXFP8] blocks of 32 consecutive elements
    amax_b = _amax(blocks, axis=-1)
    code_b = rceil_code(amax_b) if scale_rule == "rceil" else floor_code(amax_b)
    code = _per_element(code_b.astype(np.int64), t.shape, axis, MX_BLOCK)
    # q = satfinite_e4m3(t * 2^(127-e)): scaling by a power of two is exact in float64
    # (and below 2^-126 both FP32 and E4M3 give a signed zero), so no FP32 step is needed.
    data = cast_satfinite(t.astype(np.float64) * np.ldexp(1.0, 127 - code), E4M3)
    nan_block = code == E8M0_NAN  # the stored elements of a NaN block (code 255) are unspecified
    # decoded q * 2^(e-127); a block of code 255 decodes to NaN throughout.
    deq = (decode(data, E4M3).astype(np.float64) * np.ldexp(1.0, code - 127))
    with np.errstate(**_ERRSTATE):
        deq = np.where(nan_block, np.nan, deq).astype(np.float32)
    scale = np.moveaxis(code_b, -1, axis % t.ndim)
    return RefQuantized("mxfp8", data, ~nan_block, scale, e8m0_value(scale), None, deq)


# ---------------------------------------------------------------- NVFP4
def nvfp4_tensor_scales(amax_t) -> tuple[np.float32, np.float32]:
    """(S_enc, S_dec) from the tensor amax."""
    amax_t = F32(amax_t)
    with np.errstate(**_ERRSTATE):
        s_enc = F32(2688) / amax_t  # [NVFP4] "Tensor scale": S_enc = 2688 / amax_t in FP32
        s_enc = min(s_enc, F32(FLT_MAX))  # clamped to FLT_MAX
        # S_enc = 1 when amax_t is 0, infinite or NaN, or when S_enc comes out 0
        if amax_t == 0 or not np.isfinite(amax_t) or s_enc == 0:
            s_enc = F32(1)
        return F32(s_enc), F32(1) / F32(s_enc)  # S_dec = 1 / S_enc


def quantize_nvfp4(x, axis: int = -1, block_2d: bool = False) -> RefQuantized:
    t = _as_f32(x)
    s_enc, s_dec = nvfp4_tensor_scales(_amax(t, axis=None))
    if block_2d:  # [NVFP4] weights: 16x16 tiles over the two axes of W, one scale per tile
        amax_b = _amax(_tiles(t), axis=(-3, -1))
    else:  # 1x16 blocks along `axis`
        amax_b = _amax(_blocks(t, axis, NV_BLOCK), axis=-1)
    with np.errstate(**_ERRSTATE):
        # [NVFP4] "Block scales and encoding": s_b = satfinite_e4m3(amax_b * (S_enc *
        # fp32(1/6))), the product S_enc * (1/6) formed first in FP32; no lower clamp.
        s_b = cast_satfinite(amax_b * (s_enc * (F32(1) / F32(6))), E4M3)
        s_b_value = decode(s_b, E4M3)
        # enc_b = min(1 / (s_b * S_dec), FLT_MAX); np.minimum keeps a NaN s_b NaN
        enc_b = np.minimum(F32(1) / (s_b_value * s_dec), F32(FLT_MAX)).astype(np.float32)
        if block_2d:
            enc, sb_el = (_tiles_per_element(a, t.shape) for a in (enc_b, s_b_value))
        else:
            enc, sb_el = (_per_element(a, t.shape, axis, NV_BLOCK) for a in (enc_b, s_b_value))
        # q = e2m1(clip(t * enc_b, -6, 6)), the product in FP32
        scaled = np.clip(t * enc, F32(-6), F32(6)).astype(np.float32)
        data = cast_satfinite(scaled, E2M1)
        # E2M1 has no NaN: where the scaled value is NaN (NaN blocks) the code is unspecified,
        # and the block still dequantizes to NaN through its NaN scale.
        data_known = ~np.isnan(scaled)
        deq = (decode(data, E2M1) * sb_el) * s_dec  # decoded q * s_b * S_dec, in that order
        deq = np.where(data_known, deq, np.float32(np.nan)).astype(np.float32)
    if not block_2d:
        s_b = np.moveaxis(s_b, -1, axis % t.ndim)
        s_b_value = np.moveaxis(s_b_value, -1, axis % t.ndim)
    return RefQuantized("nvfp4", data, data_known, s_b, s_b_value, s_dec, deq, scaled)


# ---------------------------------------------------------------- FP8 block scaling
FP8_BLOCK = 128


def _nan_ignoring_amax(a: np.ndarray, axis) -> np.ndarray:
    """[FP8 block scaling] block amax = max |x| from 0, NaN elements ignored."""
    return np.max(np.where(np.isnan(a), F32(0), np.abs(a)), axis=axis).astype(np.float32)


def fp8_block_scale(amax, fmax: float = 448.0) -> np.ndarray:
    """[FP8 block scaling] scale = fmax / amax (FP32, nearest; fmax 448 for E4M3, 57344 for
    E5M2); 1 for amax 0, inf or NaN; an
    overflowing quotient takes the input dtype's largest finite value (FLT_MAX for float32,
    0x1.FEp127 for bfloat16: both keep exponent 127 below, so one value serves); then only
    the sign and exponent bits are kept (a power of two, rounded down)."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(**_ERRSTATE):
        scale = F32(fmax) / amax
    scale = np.where(np.isinf(scale), F32(FLT_MAX), scale)
    scale = np.where((amax == 0) | ~np.isfinite(amax), F32(1), scale).astype(np.float32)
    return (scale.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)


def quantize_fp8_block(x, axis: int = -1, block_2d: bool = False,
                       element: casts.ElementFormat = E4M3) -> RefQuantized:
    """[FP8 block scaling] 1x128 blocks along `axis`, or 128x128 tiles over the last two axes;
    every element E4M3 (fp8_block) or E5M2 (fp8_block_e5m2); per block scale_inv = 1 / scale
    (FP32); ragged edges zero-filled."""
    t = _as_f32(x)
    fmax = element.max_value
    if block_2d:
        scale_b = fp8_block_scale(_nan_ignoring_amax(_tiles(t, FP8_BLOCK), axis=(-3, -1)), fmax)
        scale = _tiles_per_element(scale_b, t.shape, FP8_BLOCK)
    else:
        scale_b = fp8_block_scale(_nan_ignoring_amax(_blocks(t, axis, FP8_BLOCK), axis=-1), fmax)
        scale = _per_element(scale_b, t.shape, axis, FP8_BLOCK)
    with np.errstate(**_ERRSTATE):
        # cast: x * scale (an exact FP32 product: scale is a power of two, and NumPy keeps
        # subnormal inputs), nearest even, saturating to +-fmax; NaN -> 0x7F (a NaN in
        # either element format) whatever its sign
        data = cast_satfinite(t * scale, element)
        data = np.where(np.isnan(t), np.uint8(0x7F), data).astype(np.uint8)
        inv_b = (F32(1) / scale_b).astype(np.float32)
        inv = (F32(1) / scale).astype(np.float32)
        deq = (decode(data, element) * inv).astype(np.float32)  # code x scale_inv
    if not block_2d:
        inv_b = np.moveaxis(inv_b, -1, axis % t.ndim)
    name = "fp8_block" if element is E4M3 else "fp8_block_e5m2"
    return RefQuantized(name, data, np.ones(t.shape, bool), inv_b, inv_b, None, deq)


def quantize(x, fmt: str, axis: int = -1, *, block_2d: bool = False,
             scale_rule: str = "rceil") -> RefQuantized:
    if fmt == "fp8_e4m3":
        return quantize_per_tensor(x, E4M3)
    if fmt == "fp8_e5m2":
        return quantize_per_tensor(x, E5M2)
    if fmt == "mxfp8":
        return quantize_mxfp8(x, axis, scale_rule)
    if fmt == "nvfp4":
        return quantize_nvfp4(x, axis, block_2d)
    if fmt == "fp8_block":
        return quantize_fp8_block(x, axis, block_2d)
    if fmt == "fp8_block_e5m2":
        return quantize_fp8_block(x, axis, block_2d, E5M2)
    raise ValueError(f"unknown fmt {fmt!r}")


# ---------------------------------------------------------------- RHT
HADAMARD_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def hadamard_matrix() -> np.ndarray:
    """[Random Hadamard transform] H = (1/4) diag(s) H16, H16 the 16x16 Sylvester Hadamard
    matrix (entries ±1), built in FP32 and cast to BF16 (every entry is ±1/4, exact in both)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < 16:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = np.block([[h, h], [h, -h]])
    return (F32(0.25) * (HADAMARD_SIGNS[:, None] * h)).astype(np.float32)


def hadamard(x, axis: int = -1) -> np.ndarray:
    """[Random Hadamard transform] each 16-element tile v along M becomes v @ H, rounded to
    BF16. The tile product is formed exactly (float64) and rounded once to BF16 (returned as
    float32 holding BF16 values)."""
    t = np.moveaxis(_as_f32(x), axis, -1).astype(np.float64)
    assert t.shape[-1] % 16 == 0, "the oracle's RHT needs a multiple of 16"
    tiles = t.reshape(t.shape[:-1] + (t.shape[-1] // 16, 16))
    out = (tiles @ hadamard_matrix().astype(np.float64)).reshape(t.shape)
    return np.moveaxis(casts.round_to_bf16(out), -1, axis).astype(np.float32)
