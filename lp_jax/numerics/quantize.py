"""The quantizers' definition: FP8 per-tensor current scaling, MXFP8 and NVFP4 in XLA
(docs/numerics.md).

A ``QuantizedTensor`` is a pytree of real low-precision arrays (``float8_e4m3fn``,
``float8_e5m2``, ``float4_e2m1fn``, ``float8_e8m0fnu``) plus static metadata, so it passes
through ``jit``, ``vmap`` and ``custom_vjp`` residuals. The block functions below work on
arrays already laid out as ``[..., n_blocks, block]``; ``quantize_xla`` only moves the
blocked axis last, pads and calls them, and every other quantizer (the GEMM operands, the
Pallas kernels) calls the same functions: one definition of every rounding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lp_jax.numerics import formats as F
from lp_jax.numerics import four_over_six
from lp_jax.numerics.division import div
from lp_jax.numerics.manual_axes import tensor_amax as manual_tensor_amax
from lp_jax.numerics.sharded_reshape import merge_axes, split_axis

FORMATS = tuple(F.FORMAT_SPECS)
ROUNDINGS = ("nearest", "stochastic")
BLOCK_SCALE_SEARCHES = (None, "4over6")  # NVFP4: TE's 4/6 block scales (numerics.four_over_six)
SCALE_RULES = ("rceil", "floor")
MX_BLOCK = F.BLOCK_SIZES["mxfp8"]
NVFP4_BLOCK = F.BLOCK_SIZES["nvfp4"]
FP8_BLOCK = F.BLOCK_SIZES["fp8_block"]
BLOCK_2D_FORMATS = ("nvfp4", "fp8_block")
NVFP4_TENSOR_SCALE_NUM = F.E2M1_MAX * F.E4M3_MAX  # 2688: amax_t maps to 6 x 448
# NumPy, not jnp: a jnp computation at import time would start the XLA backend, and
# jax.distributed.initialize (multi-host runs) must come before that.
INV_E2M1_MAX = np.float32(1) / np.float32(6)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Low-precision values with the scales that decode them.

    ``data`` has the shape of the original tensor. ``scale.astype(float32)`` is the
    dequantization factor: ``()`` per tensor; for block formats the original shape with the
    blocked axis divided by the block size (rounded up), or both last axes for 16x16 tiles.
    ``global_scale`` is NVFP4's float32 ``S_dec`` (None otherwise); with 4/6 block scales
    it is fl(amax / 1536 as amax * fl(1/1536)) and ``tensor_amax`` holds the tensor amax
    the decode uses (None for every other quantization).
    """

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))  # blocked axis (non-negative)
    block_2d: bool = dataclasses.field(default=False, metadata=dict(static=True))
    tensor_amax: jax.Array | None = None

    @property
    def shape(self):
        return self.data.shape


# --------------------------------------------------------------------------- scale rules


def tensor_scale_fp8(amax, fmax):
    """FP8-CS: scale = fmax / amax in float32; 1 if amax is 0/inf/NaN; FLT_MAX on overflow."""
    amax = amax.astype(jnp.float32)
    scale = div(jnp.float32(fmax), amax)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(F.FLT_MAX), scale)
    bad = (amax == 0) | ~jnp.isfinite(amax)
    return jnp.where(bad, jnp.float32(1), scale)


def nvfp4_tensor_scale(amax):
    """NVFP4 S_enc = 2688 / amax (float32), clamped to FLT_MAX; 1 if amax is 0/not finite."""
    amax = amax.astype(jnp.float32)
    s_enc = jnp.minimum(div(jnp.float32(NVFP4_TENSOR_SCALE_NUM), amax), jnp.float32(F.FLT_MAX))
    # isnan | isinf rather than ~isfinite: the same test, and one Mosaic GPU lowers (the
    # Pallas kernels compute S_enc from the amax themselves).
    bad = (amax == 0) | jnp.isnan(amax) | jnp.isinf(amax) | (s_enc == 0)
    return jnp.where(bad, jnp.float32(1), s_enc)


# The name FP8-CS's tensor amax carries (``jax.ad_checkpoint.checkpoint_name``): a remat
# policy that saves it (models.config.REBUILD_SAVED) keeps one scalar per quantized tensor,
# and a block rebuilt in the backward casts its tensors to FP8 again without reducing them
# again (the same amax, so the same bits). MXFP8 has no tensor amax; NVFP4's, saved so,
# cost its rebuilt MLP block more kernels than it saved (compiled for B200), so it is not
# named.
TENSOR_AMAX = "tensor_amax"


def abs_max(x, axis=None, keepdims=False):
    """Plain NaN-propagating max |x| (a NaN anywhere makes the amax NaN), as float32.

    Taken in x's own dtype (a max picks an element, so it is exact), which spares a
    materialized float32 copy of a bf16 tensor. The max is over the bits of |x| as unsigned
    integers, which order non-negative floats as their values and every NaN above inf: XLA:CPU's
    float max reduction can drop a NaN (docs/backends.md).
    """
    a = jnp.abs(x)
    uint = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    m = jnp.max(lax.bitcast_convert_type(a, uint), axis=axis, keepdims=keepdims)
    amax = lax.bitcast_convert_type(m, a.dtype).astype(jnp.float32)
    # A whole-tensor amax inside the trainer's shard_map covers every device's piece.
    return manual_tensor_amax(amax) if axis is None else amax


# --------------------------------------------------------------------------- block kernels


def quantize_per_tensor(x, dtype, amax=None):
    """Returns (data, scale_inv). ``amax`` may be given (e.g. reduced across shards)."""
    amax = checkpoint_name(abs_max(x), TENSOR_AMAX) if amax is None else amax
    scale = tensor_scale_fp8(amax, F.max_of(dtype))
    return scale_cast_fp8(x, scale, dtype), F.recip(scale)


def scale_cast_fp8(x, scale, dtype):
    """FP8-CS data: x * scale in float32, rounded to ``dtype`` with saturation (the Pallas
    cast kernel calls it on each tile with the scale read from SMEM)."""
    return F.cast_satfinite(x.astype(jnp.float32) * scale, dtype)


def along_blocks(v, shape):
    """v [..., n] broadcast along the block axis to ``shape`` [..., n, block] in one step (a
    Pallas kernel's Mosaic GPU lowering has no layout for the [..., n, 1] intermediate)."""
    return lax.broadcast_in_dim(v, shape, tuple(range(v.ndim)))


def mxfp8_blocks(xb, scale_rule="rceil", amax=None, per_block_barrier=True):
    """xb: float32 or bf16 [..., n, 32]; amax: its per-block max |x| [..., n] if already
    taken (``block_amax``). Returns (E4M3 data [..., n, 32], uint8 codes [..., n]).

    The code and its two power-of-two factors are materialized per block (the barrier):
    fused into the elementwise pass, XLA would redo their integer work for all 32 elements.
    A Pallas kernel passes per_block_barrier=False (Mosaic GPU has no lowering for the
    barrier, and a kernel computes each block's factors once anyway); the bits are the same.
    """
    code, f1, f2 = mxfp8_block_factors(abs_max(xb, axis=-1) if amax is None else amax, scale_rule)
    if per_block_barrier:
        code, f1, f2 = lax.optimization_barrier((code, f1, f2))
    # = F.mul_exp2(xb, k), with the factors broadcast along the block in one step
    data = F.cast_satfinite(xb * along_blocks(f1, xb.shape) * along_blocks(f2, xb.shape), F.E4M3)
    return data, code


def mxfp8_block_factors(amax, scale_rule="rceil"):
    """Per block: (uint8 E8M0 code, f1, f2), the data being cast_satfinite(x * f1 * f2, E4M3)."""
    code = F.e8m0_code_rceil(amax) if scale_rule == "rceil" else F.e8m0_code_floor(amax)
    # q = x * 2^(127 - e); a NaN block (255) gets any finite multiplier, it decodes to NaN.
    k = 127 - jnp.where(code == 255, 127, code.astype(jnp.int32))
    return (code, *F.exp2_factors(k))


def mxfp8_decode_factors(code):
    """Per block: (NaN mask, f1, f2) with q * f1 * f2 = q * 2^(code - 127) (``F.mul_exp2``),
    materialized for the same reason as in ``mxfp8_blocks``."""
    return lax.optimization_barrier((code == 255, *F.exp2_factors(code.astype(jnp.int32) - 127)))


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


def fp8_block_scales(amax):
    """FP8 block scaling, per block: (scale, scale_inv), float32 powers of two.

    scale = 448 / amax, FLT_MAX where that overflows, 1 where amax is 0, inf or NaN, then
    rounded down to a power of two by its exponent bits. The tests read amax's bits, not
    its value: a subnormal amax compares equal to 0 on CPU (denormals are zero there), and
    its quotient overflows either way. scale_inv is built from bits too: 2^-127, the
    reciprocal of the largest scale, is subnormal."""
    amax = amax.astype(jnp.float32)
    bits = F.f32_bits(amax)
    scale = div(jnp.float32(F.E4M3_MAX), amax)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(F.FLT_MAX), scale)
    scale = jnp.where((bits == 0) | (bits >= 0x7F800000), jnp.float32(1), scale)
    e = (F.f32_bits(scale) >> 23) & 0xFF  # scale >= 448 / FLT_MAX: always normal
    inv_bits = jnp.where(e == 254, jnp.uint32(0x00400000), (254 - e) << 23)
    return (lax.bitcast_convert_type(e << 23, jnp.float32),
            lax.bitcast_convert_type(inv_bits.astype(jnp.uint32), jnp.float32))


def fp8_block_encode(x, scale):
    """E4M3 codes of x * scale (scale a power of two, broadcast to x): nearest even,
    saturating to +-448, NaN to the positive NaN code 0x7F. The product is exact; a
    subnormal x is scaled from its integer mantissa, since CPU flushes it as an operand."""
    x = x.astype(jnp.float32)
    bits = F.f32_bits(x)
    k = ((F.f32_bits(scale) >> 23) & 0xFF).astype(jnp.int32) - 127
    # x = m * 2^-149 for a subnormal; k - 149 >= -252 keeps mul_exp2's factors normal (below
    # that the product is far under E4M3's smallest subnormal, 2^-9, and rounds to zero).
    tiny = F.mul_exp2((bits & 0x7FFFFF).astype(jnp.float32), jnp.maximum(k - 149, -252))
    y = jnp.where(((bits >> 23) & 0xFF) == 0, jnp.copysign(tiny, x), x * scale)
    y = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), y)
    return F.cast_satfinite(y, F.E4M3)


def _without_nan(x):
    """FP8 block scaling's amax ignores NaN elements (they still encode as NaN)."""
    return jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)


def quantize_fp8_block(xf, axis, block_2d=False) -> QuantizedTensor:
    """1x128 blocks along ``axis``, or 128x128 tiles over the last two axes."""
    if block_2d:
        r, c = xf.shape[-2:]
        xt = to_tiles(xf, FP8_BLOCK)
        scale, inv = fp8_block_scales(abs_max(_without_nan(xt), axis=(-3, -1)))
        data = fp8_block_encode(xt, scale[..., :, None, :, None])
        return QuantizedTensor(from_tiles(data, r, c), inv, None, "fp8_block", xf.ndim - 1, True)
    scale, inv = fp8_block_scales(block_amax(_without_nan(xf), axis, FP8_BLOCK))
    xb = to_blocks(xf, axis, FP8_BLOCK)
    data = from_blocks(fp8_block_encode(xb, along_blocks(scale, xb.shape)), axis, xf.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(inv, -1, axis), None, "fp8_block", axis)


# --------------------------------------------------------------------------- layout


def to_blocks(x, axis, block):
    """Moves ``axis`` last, zero-pads it to a multiple of ``block``, splits it into blocks."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return split_axis(x, -1, ((n + pad) // block, block))


def to_blocks_in_place(x, block):
    """Zero-pads x's first axis to a multiple of ``block`` and splits it into [n, block, ...]:
    blocks along the first axis in x's own element order (``to_blocks(x, 0, block)`` holds
    the same blocks, moved last, at the cost of a transposed copy)."""
    pad = -x.shape[0] % block
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return split_axis(x, 0, (x.shape[0] // block, block))


def block_amax(x, axis, block):
    """The per-block max |x| of ``to_blocks(x, axis, block)``, [..., n_blocks], reduced in x's
    own layout and dtype: along a non-minor axis, reducing the moved copy would make XLA
    write out a transposed (and upcast) copy of x first."""
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        return abs_max(to_blocks(x, axis, block), axis=-1)
    n = x.shape[axis]
    pad = -n % block
    if pad:
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
    xb = split_axis(x, axis, ((n + pad) // block, block))
    return jnp.moveaxis(abs_max(xb, axis=axis + 1), axis, -1)


def unblocked(xb, n):
    """[..., blocks, block] -> [..., n]: the blocked axis, still last, without its padding."""
    return merge_axes(xb, -2, 2)[..., :n]


def from_blocks(xb, axis, n):
    return jnp.moveaxis(unblocked(xb, n), -1, axis)


def to_tiles(x, tile=NVFP4_BLOCK):
    """[..., R, C] -> zero-padded [..., R/t, t, C/t, t] (t = 16 by default)."""
    r, c = x.shape[-2:]
    pr, pc = -r % tile, -c % tile
    if pr or pc:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pr), (0, pc)])
    x = split_axis(x, -1, ((c + pc) // tile, tile))
    return split_axis(x, -3, ((r + pr) // tile, tile))


def from_tiles(xt, r, c):
    return merge_axes(merge_axes(xt, -2, 2), -3, 2)[..., :r, :c]


# --------------------------------------------------------------------------- public API


def check_quantize_args(x, fmt, axis, block_2d, rounding, key, scale_rule, block_scale_search=None,
                        metric="mae"):
    """One line (ValueError) for arguments ``lp_jax.quantize`` does not accept."""
    if block_scale_search not in BLOCK_SCALE_SEARCHES:
        raise ValueError(f"block_scale_search={block_scale_search!r} is not valid; expected one of "
                         f"{BLOCK_SCALE_SEARCHES}")
    if block_scale_search and fmt != "nvfp4":
        raise ValueError(f"block_scale_search={block_scale_search!r} is only defined for fmt='nvfp4', "
                         f"got fmt={fmt!r}")
    if metric not in four_over_six.METRICS:
        raise ValueError(f"metric={metric!r} is not valid; expected one of {four_over_six.METRICS}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is not a known format; expected one of {FORMATS}")
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array (bfloat16 or float32), got dtype {dtype}")
    ndim = jnp.ndim(x)
    if ndim == 0 and F.FORMAT_SPECS[fmt].block:
        raise ValueError(f"x must have at least one axis for block format {fmt!r}")
    if ndim and not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {ndim}")
    if block_2d and fmt not in BLOCK_2D_FORMATS:
        raise ValueError(f"block_2d=True is only defined for fmt in {BLOCK_2D_FORMATS}, got fmt={fmt!r}")
    if block_2d and ndim < 2:
        b = F.BLOCK_SIZES[fmt]
        raise ValueError(f"block_2d=True needs at least 2 axes ({b}x{b} tiles over the last two), "
                         f"got rank {ndim}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not valid; expected one of {ROUNDINGS}")
    if rounding == "stochastic" and fmt != "nvfp4":
        raise ValueError(f"rounding='stochastic' is only defined for fmt='nvfp4', got fmt={fmt!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs key= (a jax.random key)")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule={scale_rule!r} is not valid; expected one of {SCALE_RULES}")


def quantize_xla(x, fmt, axis=-1, *, block_2d=False, rounding="nearest", key=None,
                 scale_rule="rceil", tensor_amax=None, block_scale_search=None,
                 metric="mae") -> QuantizedTensor:
    """``lp_jax.quantize(x, fmt, axis, ..., impl="xla")``: the arguments are checked, then
    quantized by this module's block functions.

    tensor_amax: max |x| of the whole tensor when x is one shard of it (reduced across the
    shards by the caller), for the per-tensor scales of fp8_e4m3/fp8_e5m2 and nvfp4.
    """
    check_quantize_args(x, fmt, axis, block_2d, rounding, key, scale_rule, block_scale_search, metric)
    x = jnp.asarray(x)
    ndim = x.ndim
    axis = axis % ndim if ndim else 0
    # Widened through its bits (formats.exact_f32): on a GPU, XLA would otherwise quantize
    # the float32 value a fused producer had before rounding it to x's bf16.
    xf = F.exact_f32(x)
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        data, scale_inv = quantize_per_tensor(xf, F.FORMAT_SPECS[fmt].element, tensor_amax)
        return QuantizedTensor(data, scale_inv, None, fmt, axis)
    if fmt == "fp8_block":
        return quantize_fp8_block(xf, axis, block_2d)
    if fmt == "mxfp8":
        data_b, code = mxfp8_blocks(to_blocks(xf, axis, MX_BLOCK), scale_rule, block_amax(xf, axis, MX_BLOCK))
        data = from_blocks(data_b, axis, x.shape[axis])
        return QuantizedTensor(data, jnp.moveaxis(F.e8m0_from_code(code), -1, axis), None, fmt, axis)
    if block_scale_search == "4over6":
        return _quantize_nvfp4_4over6(xf, axis, block_2d, rounding, key, metric,
                                      abs_max(xf) if tensor_amax is None else tensor_amax)
    s_enc = nvfp4_tensor_scale(abs_max(xf) if tensor_amax is None else tensor_amax)
    s_dec = F.recip(s_enc)  # may be a float32 subnormal: kept as bits, applied by F.mul
    if block_2d:
        r, c = x.shape[-2:]
        data_t, s_b = nvfp4_tiles(to_tiles(xf), s_enc, rounding, key)
        return QuantizedTensor(from_tiles(data_t, r, c), s_b, s_dec, fmt, ndim - 1, True)
    data_b, s_b = nvfp4_blocks(to_blocks(xf, axis, NVFP4_BLOCK), s_enc, rounding, key,
                               block_amax(xf, axis, NVFP4_BLOCK))
    data = from_blocks(data_b, axis, x.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(s_b, -1, axis), s_dec, fmt, axis)


def _quantize_nvfp4_4over6(xf, axis, block_2d, rounding, key, metric, amax_t) -> QuantizedTensor:
    amax_t = amax_t.astype(jnp.float32)
    g = four_over_six.global_scale(amax_t)
    if block_2d:
        r, c = xf.shape[-2:]
        xt = to_tiles(xf)
        s_b, enc = four_over_six.choose_scales(xt, abs_max(xt, axis=(-3, -1)), amax_t, True, metric)
        data = from_tiles(nvfp4_encode(xt, enc[..., :, None, :, None], rounding, key), r, c)
        return QuantizedTensor(data, s_b, g, "nvfp4", xf.ndim - 1, True, amax_t)
    xb = to_blocks(xf, axis, NVFP4_BLOCK)
    s_b, enc = four_over_six.choose_scales(xb, block_amax(xf, axis, NVFP4_BLOCK), amax_t, False, metric)
    data = from_blocks(nvfp4_encode(xb, enc[..., None], rounding, key), axis, xf.shape[axis])
    return QuantizedTensor(data, jnp.moveaxis(s_b, -1, axis), g, "nvfp4", axis, False, amax_t)


def as_quantizer_input(x):
    """x as bf16 or f32, what the quantizers take (the Pallas kernels read bf16 as it is;
    ``quantize_xla`` widens it with ``formats.exact_f32``)."""
    return x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32)


def _expand(scale, axis, block, n):
    """Repeats block scales along ``axis`` to element resolution (length n)."""
    return lax.slice_in_dim(jnp.repeat(scale, block, axis=axis), 0, n, axis=axis)


def block_values(q: QuantizedTensor):
    """Block-format values without the tensor scale, float32: q * 2^(e-127) for MXFP8
    (exact; applied as two normal powers of two, since 2^-127 alone is subnormal),
    q * s_b for NVFP4 (exact in bf16)."""
    data = q.data.astype(jnp.float32)
    if q.fmt == "fp8_block":  # code x scale_inv, which may be the subnormal 2^-127
        return F.mul(data, _per_element(q))
    if q.fmt == "mxfp8":
        nan, f1, f2 = mxfp8_decode_factors(lax.bitcast_convert_type(q.scale, jnp.uint8))
        nan, f1, f2 = (_expand(a, q.axis, MX_BLOCK, data.shape[q.axis]) for a in (nan, f1, f2))
        return jnp.where(nan, jnp.float32(jnp.nan), data * f1 * f2)
    return data * _per_element(q)


def _per_element(q: QuantizedTensor, per_block=None):
    """q's block scales (as float32), or another per-block array, repeated to the shape of its data."""
    scale = q.scale.astype(jnp.float32) if per_block is None else per_block
    block, shape = F.BLOCK_SIZES[q.fmt], q.data.shape
    if q.block_2d:
        return _expand(_expand(scale, scale.ndim - 2, block, shape[-2]), scale.ndim - 1, block, shape[-1])
    return _expand(scale, q.axis, block, shape[q.axis])


def dequantize(q: QuantizedTensor):
    """float32 values of ``q``, the shape of the original tensor."""
    if q.fmt in ("fp8_e4m3", "fp8_e5m2"):
        return F.mul(q.data.astype(jnp.float32), q.scale)
    if q.tensor_amax is not None:  # 4/6 block scales: code x ((s x amax) x fl(1/1536))
        factors = four_over_six.dequantize_factors(q.scale, q.tensor_amax)
        return q.data.astype(jnp.float32) * _per_element(q, factors)
    values = block_values(q)
    # NVFP4: q * s_b is exact; S_dec last, as the GEMM applies it after accumulation.
    return values if q.global_scale is None else F.mul(values, q.global_scale)
