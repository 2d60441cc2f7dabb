"""The "cudnn" backend: MXFP8, NVFP4 and FP8 block GEMMs through ``jax.nn.scaled_matmul``.

``scaled_matmul`` takes lhs (B, M, K), rhs (B, N, K) and their block scales, infers the
block size from the shapes and returns lhs x rhs^T: lowered for CUDA, the
``__op$block_scaled_dot`` custom call (docs/backends.md); on CPU, a dequantize-and-dot
composite, which is how it is tested against the reference. Every operand goes in with its
contraction axis last (B = 1), as ``lp_jax.quantize``'s bytes and scales, the bits the
reference decodes. K is zero-padded to a multiple of 4 blocks and the rows to a multiple of
128 (cuDNN's block-scale tile), and the result is sliced back. NVFP4's FP32 tensor scales
multiply the FP32 result outside the call, one rounding each, as in the reference
(``operands.scale_result``: plain multiplies on CUDA, which XLA fuses into the next kernel).
Without tensor scales (MXFP8, FP8 block), a call lowered for CUDA returns the result in
the output dtype: the GEMM rounds its FP32 accumulator once, as the FP32 result's cast
would, and writes (and its consumer reads) half the bytes (docs/backends.md).
FP8 block scaling runs as MXFP8: its FP32 scales are powers of two (2^-127 at the least),
which E8M0 holds exactly, and a 1x128 block (or a row of a 128x128 tile) is four 1x32
blocks with its scale repeated, as Transformer Engine runs that recipe on Blackwell.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.gemm.operands import (
    Pending,
    Transposed,
    quantize_kwargs,
    scale_result,
    stored,
    transformed,
    uses_pallas,
)
from lp_jax.gemm.tensor_reduce import TENSOR
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import FP8_BLOCK, MX_BLOCK, QuantizedTensor
from lp_jax.numerics.registry import REGISTRY, format_named
from lp_jax.quantizer import quantize

ROW_TILE = 128  # rows per tile of cuDNN's block-scale layout (128 x 4 scales)
SCALE_COLUMN_TILE = 4  # scale columns (blocks along K) per tile
# Block formats by element type (E4M3 -> MXFP8's 32, E2M1 -> NVFP4's 16): the formats
# cuDNN's block-scaled GEMM takes as they are (E8M0 or E4M3 scales).
BLOCK_OF = {jnp.dtype(f.element): f.block for f in REGISTRY.values() if f.scale in (F.E8M0, F.E4M3)}


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def _tile_scales(q: QuantizedTensor, axis: int):
    """Per-row block scales of a tiled operand (16x16, 128x128) read contracting ``axis``:
    each row of the contraction-last layout gets the scale of the tile it lies in."""
    scales = q.scale if axis == 1 else q.scale.T
    rows = q.data.shape[1 - axis]
    return jnp.repeat(scales, format_named(q.fmt).block, axis=0)[:rows]


def as_mx_scales(scales, k):
    """FP8 block scales (FP32 powers of two, [rows, K / 128]) as the E8M0 scales of 1x32
    blocks [rows, K / 32]: the exponent field is the E8M0 code, 2^-127 (subnormal, field
    0) included."""
    codes = (F.f32_bits(scales) >> 23) & 0xFF
    per = FP8_BLOCK // MX_BLOCK
    return F.e8m0_from_code(jnp.repeat(codes, per, axis=1)[:, :-(-k // MX_BLOCK)])


def block_operand(p, axis: int):
    """(data [rows, K], block scales [rows, K / block], tensor factor or None) of operand p
    contracted over its ``axis``, the contraction last."""
    if isinstance(p, Pending) and uses_pallas(p.spec):
        p = stored(p.t, p.spec, p.axis, p.key)  # the kernels write this layout in one pass
    if isinstance(p, Pending):
        if p.axis != axis:
            raise ValueError(f"operand quantized along axis {p.axis} cannot be contracted over {axis}")
        t = transformed(p.t, p.spec, p.axis)
        kw = quantize_kwargs(p.spec, p.key)
        if p.spec.block_2d:
            p = quantize(t, p.spec.fmt, axis=axis, **kw)
        else:
            # The same blocks (and stochastic bits, indexed in this layout) as the reference's.
            q = quantize(jnp.moveaxis(t, axis, -1), p.spec.fmt, axis=-1, **kw)
            return q.data, q.scale, q.global_scale
    if isinstance(p, Transposed) and axis == 0:
        return p.q.data, p.q.scale, p.q.global_scale
    if isinstance(p, QuantizedTensor) and format_named(p.fmt).block:
        if p.block_2d:
            return jnp.moveaxis(p.data, axis, -1), _tile_scales(p, axis), p.global_scale
        if p.axis == axis:
            return jnp.moveaxis(p.data, axis, -1), jnp.moveaxis(p.scale, axis, -1), p.global_scale
    raise ValueError(f"the cudnn backend multiplies block-scaled operands blocked along the "
                     f"contraction axis {axis}; got {type(p).__name__}")


def _padded(data, scales, block):
    rows, k = data.shape
    pad_rows = _round_up(rows, ROW_TILE) - rows
    pad_k = _round_up(k, block * SCALE_COLUMN_TILE) - k
    if not (pad_rows or pad_k):
        return data, scales
    data = jnp.pad(data, ((0, pad_rows), (0, pad_k)))
    pad_cols = (k + pad_k) // block - scales.shape[1]
    # Padded scales are 1.0: jnp would cast 0 to E8M0 as NaN (E8M0 has no zero).
    scales = jnp.pad(scales, ((0, pad_rows), (0, pad_cols)), constant_values=jnp.ones((), scales.dtype))
    return data, scales


def block_operands(a, b, contracting):
    """Both operands of a block-scaled GEMM, contraction last: (lhs data, lhs scales, lhs
    tensor factor, rhs data, rhs scales, rhs factor, block size), FP8 block scaling's
    scales as MXFP8's (E8M0, 1x32)."""
    (ca,), (cb,) = contracting
    ad, as_, fa = block_operand(a, ca)
    bd, bs, fb = block_operand(b, cb)
    if as_.dtype == jnp.float32:  # FP8 block scaling (E4M3, or E5M2 gradients), both operands
        as_, bs = as_mx_scales(as_, ad.shape[1]), as_mx_scales(bs, bd.shape[1])
        return ad, as_, fa, bd, bs, fb, MX_BLOCK
    return ad, as_, fa, bd, bs, fb, BLOCK_OF[jnp.dtype(ad.dtype)]


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """a x b over ``contracting`` in one block-scaled GEMM (FP32 accumulation), in out_dtype."""
    ad, as_, fa, bd, bs, fb, block = block_operands(a, b, contracting)
    rows_a, rows_b = ad.shape[0], bd.shape[0]
    ad, as_ = _padded(ad, as_, block)
    bd, bs = _padded(bd, bs, block)
    # Where XLA expands the call (Hopper) it converts the bytes back up; the barrier keeps
    # that convert from meeting our quantizer's and being folded away as excess precision.
    ad, bd, as_, bs = lax.optimization_barrier((ad, bd, as_, bs))

    def gemm(result_dtype):
        def run(ad, bd, as_, bs):
            out = jax.nn.scaled_matmul(ad[None], bd[None], as_[None], bs[None],
                                       preferred_element_type=result_dtype)
            return scale_result(out[0, :rows_a, :rows_b], fa, fb).astype(out_dtype)
        return run

    if not _rounds_in_gemm(out_dtype, fa, fb):
        return gemm(jnp.float32)(ad, bd, as_, bs)
    # XLA:CPU's composite dot in a 16-bit type does not round an FP32 sum once (its bits
    # differ from the cast's), so the CPU keeps the FP32 result: it stays the reference's.
    return lax.platform_dependent(ad, bd, as_, bs, default=gemm(jnp.float32), cuda=gemm(out_dtype))


def _rounds_in_gemm(out_dtype, fa, fb) -> bool:
    """Whether the GEMM may return its result in ``out_dtype``: a 16-bit float, no tensor
    factor to apply after it (NVFP4's are applied to the FP32 result, one rounding each) and
    no tensor axis, where the contraction may be split over devices and the partial results
    must be summed before the one rounding."""
    if fa is not None or fb is not None or jnp.dtype(out_dtype).itemsize != 2:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.shape.get(TENSOR, 1) == 1
