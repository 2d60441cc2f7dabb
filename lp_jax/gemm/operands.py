"""Quantizing GEMM operands per an OperandSpec, and turning them back into GEMM inputs.

A prepared operand is either a bf16 array (spec.fmt None) or a compact QuantizedTensor,
which is what the backward keeps as a residual. ``gemm_inputs`` turns it into the values a
GEMM multiplies plus one float32 factor applied after accumulation:

- FP8 per tensor: the FP8 values; factor scale_inv.
- MXFP8: q * 2^(e-127), exact in bf16 (a power-of-two scale); factor 1.
- NVFP4: q * s_b, exact in bf16 (2 + 4 significant bits); factor S_dec.

So "dequantize both operands, FP32 dot" is computed with bf16 inputs and FP32
accumulation, and the tensor factors are applied once to the FP32 result, as the
hardware block-scaled GEMM does.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.numerics import formats as F

from lp_jax.numerics.decoded import quantized_values
from lp_jax.numerics.hadamard import RHT_SIZE, hadamard
from lp_jax.numerics.quantize import QuantizedTensor, block_values, quantize
from lp_jax.recipes import OperandSpec

PER_TENSOR = F.PER_TENSOR_FORMATS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
    """An operand quantized for immediate use: its dequantized values over ``factor``."""

    values: jax.Array
    factor: jax.Array | None


def prepare(t, spec: OperandSpec, axis: int, key=None, store=False):
    """Quantizes t (2-D, compute dtype) along ``axis`` as ``spec`` says; t itself if fmt is None.

    store=True returns a packed QuantizedTensor (what the backward keeps); otherwise the
    decoded values for an immediate GEMM, without a packed copy (lp_jax.numerics.decoded).
    """
    if spec.rht:
        t = hadamard(pad_to(t, axis, RHT_SIZE), axis=axis)
    if spec.fmt is None:
        return t
    kw = dict(block_2d=spec.block_2d, rounding="stochastic" if spec.stochastic else "nearest",
              key=key if spec.stochastic else None, scale_rule=spec.scale_rule)
    if store or (spec.fmt in PER_TENSOR):  # FP8 bytes are needed as such by a native FP8 GEMM
        return quantize(t, spec.fmt, axis=axis, **kw)
    values, factor = quantized_values(t, spec.fmt, axis, **kw)
    return Decoded(values.astype(t.dtype), factor)


def shares_bytes(a: OperandSpec, b: OperandSpec) -> bool:
    """Whether one quantized copy can serve both uses (different contraction axes).

    True for per-tensor formats and for 16x16 tiles (symmetric in both axes), and for
    unquantized operands; never for 1-D blocks or an RHT'd copy.
    """
    if a != b or a.rht:
        return False
    return a.fmt is None or a.fmt in PER_TENSOR or a.block_2d


def pad_to(t, axis, multiple):
    pad = -t.shape[axis] % multiple
    if not pad:
        return t
    widths = [(0, 0)] * t.ndim
    widths[axis] = (0, pad)
    return jnp.pad(t, widths)


def gemm_inputs(p, compute_dtype, native_fp8=False):
    """(values, factor) for a GEMM: values of p times factor are its dequantized values.

    Quantized values are exact in bf16, so any float compute_dtype represents them exactly.

    The optimization barrier keeps XLA (on GPU, with excess precision allowed) from
    folding the f32 -> fp8 -> bf16 round trip away, which would silently skip quantization.
    With ``native_fp8`` an FP8 per-tensor operand is returned in FP8 for a native FP8 GEMM.
    """
    if isinstance(p, Decoded):
        return p.values.astype(compute_dtype), p.factor
    if not isinstance(p, QuantizedTensor):
        return p.astype(compute_dtype), None
    data = lax.optimization_barrier(p.data)
    if p.fmt in PER_TENSOR:
        values = data if native_fp8 else data.astype(compute_dtype)
        return values, p.scale
    values = block_values(dataclasses.replace(p, data=data)).astype(compute_dtype)
    return values, p.global_scale


def _is_fp8(p):
    return isinstance(p, QuantizedTensor) and p.fmt in PER_TENSOR


def scaled_dot(a, b, contracting, compute_dtype, out_dtype, native_fp8=False):
    """Contracts prepared operands a and b in FP32 accumulation, applies both tensor
    factors to the FP32 result, casts to out_dtype. contracting: ((a_axis,), (b_axis,)).

    An RHT'd pair was zero-padded along M before the transform; since H is orthogonal the
    padded product equals the unpadded one, so nothing needs slicing here.
    """
    native = native_fp8 and _is_fp8(a) and _is_fp8(b)
    av, fa = gemm_inputs(a, compute_dtype, native_fp8=native)
    bv, fb = gemm_inputs(b, compute_dtype, native_fp8=native)
    out = lax.dot_general(av, bv, (contracting, ((), ())), preferred_element_type=jnp.float32)
    for factor in (fa, fb):
        if factor is not None:
            out = F.mul(out, factor)  # the factor may be a float32 subnormal (formats.recip)
    return out.astype(out_dtype)
