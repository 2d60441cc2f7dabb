"""GEMM operands: what the dot_general hands a backend, and the reference GEMM that defines them.

An operand is a bf16 array (spec.fmt None), a ``QuantizedTensor`` (packed bytes, the same
for every backend), a ``Transposed`` QuantizedTensor (a block copy along the tensor's first
axis, stored transposed: TE's columnwise copy) or a ``Pending`` operand, consumed at once,
which each backend quantizes itself with the same rounding and stochastic bits. The
reference GEMM (``scaled_dot``) multiplies each operand's exact dequantized values in bf16
over at most one float32 factor (FP8: scale_inv; MXFP8: none; NVFP4: S_dec), accumulates in
FP32 and applies the factors once to the FP32 result, as a block-scaled GEMM does.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.kernels.api import block_pair
from lp_jax.numerics import formats as F
from lp_jax.numerics.decoded import quantized_values
from lp_jax.numerics.hadamard import RHT_SIZE, hadamard
from lp_jax.numerics.quantize import QuantizedTensor, block_values, format_named
from lp_jax.quantizer import quantize, resolve_impl
from lp_jax.recipes import OperandSpec, Recipe


def per_tensor(spec: OperandSpec) -> bool:
    """Whether spec quantizes to a per-tensor format (FP8-CS): one copy serves every GEMM axis."""
    return spec.fmt is not None and format_named(spec.fmt).per_tensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
    """An operand quantized for immediate use: its dequantized values over ``factor``, laid
    out with the contraction axis last (the layout its blocks were computed in) or, where
    ``axis`` is 0, in the tensor's own layout (blocks down its columns)."""

    values: jax.Array
    factor: jax.Array | None
    axis: int = dataclasses.field(default=-1, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """A block-format operand each backend quantizes itself: t along ``axis`` as ``spec`` says."""

    t: jax.Array
    key: jax.Array | None  # stochastic rounding key (None without SR)
    spec: OperandSpec = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Transposed:
    """``q`` quantizes the transpose of a 2-D operand along its last axis, which is the
    operand's first axis: the copy a GEMM contracting over that axis reads in place."""

    q: QuantizedTensor


def transformed(t, spec: OperandSpec, axis: int):
    """t after the RHT along ``axis`` (zero-padded to a multiple of 16) if spec asks for it.

    On CPU the transform is materialized once (behind a barrier): fused into each of its
    consumers (tensor amax, block amaxes, encoding), XLA would redo its 16-term butterfly
    in every one of them."""
    if not spec.rht:
        return t
    h = hadamard(pad_to(t, axis, RHT_SIZE), axis=axis)
    return lax.platform_dependent(h, cpu=lax.optimization_barrier, default=lambda h: h)


def weight_source(recipe: Recipe, w, x_dtype):
    """What a kernel's GEMM copies are made from. With ``param_gather`` (Transformer Engine's
    fp8/fp4_param_gather, whose FP8/FP4 weights the optimizer writes from its FP32 masters)
    the master itself, one rounding to FP8/FP4 with the scales of its own amaxes; otherwise
    its cast to the compute dtype (``x_dtype``), which TE's BF16 module weights are: two
    roundings. BF16 GEMMs always read the cast."""
    if recipe.param_gather and recipe.fprop_w.fmt is not None and recipe.dgrad_w.fmt is not None:
        return w.astype(jnp.float32)
    return w.astype(x_dtype)


def quantize_kwargs(spec: OperandSpec, key=None) -> dict:
    search = (dict(block_scale_search=spec.block_scale_search, metric=spec.metric)
              if spec.block_scale_search else {})
    return dict(block_2d=spec.block_2d, scale_rule=spec.scale_rule, **search, **_rounding(spec, key))


def uses_pallas(spec: OperandSpec) -> bool:
    """Whether spec's copies come from the Pallas kernels (``lp_jax.kernels``; the same bits).
    Never for 4/6 block scales, which only XLA quantizes."""
    return (spec.fmt is not None and not spec.block_scale_search
            and resolve_impl(spec.quantize_impl, spec.fmt) == "pallas")


def operand(t, spec: OperandSpec, axis: int, key=None):
    """t (2-D, compute dtype) as a GEMM consuming it at once gets it, contracting ``axis``:
    t itself (BF16), FP8 bytes (per tensor: the same for every backend) or Pending."""
    if spec.fmt is None:
        return t
    if per_tensor(spec):
        return quantize(t, spec.fmt, axis=axis, impl=spec.quantize_impl, **quantize_kwargs(spec, key))
    return Pending(t, key, spec, axis)


def operand_pair(t, spec_a: OperandSpec, axis_a: int, spec_b: OperandSpec, axis_b: int, key_a=None, key_b=None,
                 *, keep_b: bool):
    """The copies of t for two GEMMs contracting its two axes: (operand(t, spec_a, axis_a), and
    stored(t, spec_b, axis_b) if the backward keeps it (keep_b) or else operand(...)). With the
    Pallas quantizer and 1-D blocks of one format along both axes, both come from one read
    of t (one kernel); otherwise each its own way. The values are the same either way."""
    row_spec, col_spec = (spec_a, spec_b) if axis_a == 1 else (spec_b, spec_a)
    fused = (uses_pallas(spec_a) and uses_pallas(spec_b) and spec_a.fmt == spec_b.fmt
             and not per_tensor(spec_a) and not (spec_a.block_2d or spec_b.block_2d) and not row_spec.rht)
    if not fused:
        return operand(t, spec_a, axis_a, key_a), (stored if keep_b else operand)(t, spec_b, axis_b, key_b)
    if axis_a == 1:
        row, col = block_pair(t, spec_a, spec_b, key_a, key_b)
        return row, Transposed(col)
    row, col = block_pair(t, spec_b, spec_a, key_b, key_a)
    return Transposed(col), row


def stored(t, spec: OperandSpec, axis: int, key=None):
    """The packed copy of t the backward keeps, contracting ``axis``: per-tensor bytes and
    16x16 tiles serve either axis as they are; 1-D blocks along the first axis are kept
    Transposed, so every backend reads the same bytes."""
    if spec.fmt is None:
        return t
    if uses_pallas(spec) and not (per_tensor(spec) or spec.block_2d):
        # One kernel, the RHT fused into the column copy's pass.
        row, col = block_pair(t, spec, None, key) if axis == t.ndim - 1 else block_pair(t, None, spec, None, key)
        return row if col is None else Transposed(col)
    t = transformed(t, spec, axis)
    if per_tensor(spec) or spec.block_2d or axis == t.ndim - 1:
        return quantize(t, spec.fmt, axis=axis, impl=spec.quantize_impl, **quantize_kwargs(spec, key))
    return Transposed(quantize(jnp.moveaxis(t, axis, -1), spec.fmt, axis=-1, **quantize_kwargs(spec, key)))


def decoded(p: Pending):
    """The reference's form of a Pending operand: its exact dequantized values over the
    tensor factor, without packed bytes (``lp_jax.numerics.decoded``): contraction axis last,
    except NVFP4 1-D blocks along the first axis of a 2-D operand (the wgrad's dy), which stay
    in place: the GEMM reads them as they are, and moving them would cost a transposed pass."""
    t = transformed(p.t, p.spec, p.axis)
    fmt = format_named(p.spec.fmt)
    if fmt.decodes_in_place and not (p.spec.block_2d or p.spec.block_scale_search) and t.ndim == 2 \
            and p.axis == 0:
        values, factor = fmt.values_in_place(t, **_rounding(p.spec, p.key))
        return Decoded(values.astype(t.dtype), factor, axis=0)
    values, factor = quantized_values(t, p.spec.fmt, p.axis, **quantize_kwargs(p.spec, p.key))
    return Decoded(values.astype(t.dtype), factor)


def _rounding(spec: OperandSpec, key) -> dict:
    return dict(rounding="stochastic" if spec.stochastic else "nearest", key=key if spec.stochastic else None)


def shares_bytes(a: OperandSpec, b: OperandSpec) -> bool:
    """Whether one quantized copy can serve both uses (different contraction axes).

    True for per-tensor formats and for 16x16 tiles (symmetric in both axes), and for
    unquantized operands; never for 1-D blocks or an RHT'd copy.
    """
    if a != b or a.rht:
        return False
    return a.fmt is None or per_tensor(a) or a.block_2d


def pad_to(t, axis, multiple):
    pad = -t.shape[axis] % multiple
    if not pad:
        return t
    widths = [(0, 0)] * t.ndim
    widths[axis] = (0, pad)
    return jnp.pad(t, widths)


def gemm_inputs(p, compute_dtype, axis):
    """(values, factor, contraction axis of values) for the reference GEMM of operand p
    contracted over its ``axis``: values of p times factor are its dequantized values.
    Quantized values are exact in bf16, so any float compute_dtype holds them exactly.
    Operands quantized in a transposed layout (Pending, Transposed) keep it: their
    contraction axis is last.

    The optimization barrier keeps XLA (on GPU, with excess precision allowed) from
    folding the f32 -> fp8 -> bf16 round trip away, which would silently skip quantization.
    """
    if isinstance(p, Pending):
        # The Pallas kernels write bytes (no decode-only kernel); their values are decoded's.
        p = stored(p.t, p.spec, p.axis, p.key) if uses_pallas(p.spec) else decoded(p)
    if isinstance(p, Decoded):
        return p.values.astype(compute_dtype), p.factor, p.axis % p.values.ndim
    if isinstance(p, Transposed):
        values, factor, _ = gemm_inputs(p.q, compute_dtype, p.q.data.ndim - 1)
        return (values, factor, 1) if axis == 0 else (values.T, factor, axis)
    if not isinstance(p, QuantizedTensor):
        return p.astype(compute_dtype), None, axis
    data = lax.optimization_barrier(p.data)
    if format_named(p.fmt).per_tensor:
        return data.astype(compute_dtype), p.scale, axis
    values = block_values(dataclasses.replace(p, data=data)).astype(compute_dtype)
    return values, p.global_scale, axis


def f32_dot(av, ca, bv, cb):
    """av x bv contracted over (ca, cb), 2-D operands, FP32 accumulation and result.

    XLA:CPU runs a BF16 dot as its fast BF16 GEMM only when the left operand it is
    given is laid out row-major with its contraction axis last; a transposed one (even a
    transpose behind an optimization barrier, which layout assignment turns back into a
    column-major view) makes it upcast both operands to FP32. The one form it
    rewrites into a materialized row-major copy is a dot contracting two axes of each
    operand: on CPU, a left operand contracting its first axis (the wgrad's tokens) gets a
    leading unit axis and both operands contract (unit, tokens). Only FP32 summation order
    can differ. Elsewhere the GEMM reads either layout and the transpose folds away."""
    if ca == 1:
        return lax.dot_general(av, bv, (((1,), (cb,)), ((), ())), preferred_element_type=jnp.float32)

    def cpu(av, bv):
        b3, cb3 = (bv[None], (0, 1)) if cb == 0 else (bv[:, None], (1, 2))
        return lax.dot_general(av[None], b3, (((0, 1), cb3), ((), ())), preferred_element_type=jnp.float32)

    def default(av, bv):
        return lax.dot_general(av.T, bv, (((1,), (cb,)), ((), ())), preferred_element_type=jnp.float32)

    return lax.platform_dependent(av, bv, cpu=cpu, default=default)


def apply_factors(out, *factors, mul=F.mul):
    """The FP32 GEMM result times the operands' tensor factors, one rounding each, as the
    reference applies them (a factor may be a float32 subnormal: formats.mul)."""
    for factor in factors:
        if factor is not None:
            out = mul(out, factor)
    return out


def scale_result(out, *factors):
    """``apply_factors`` as the platform the program is lowered for computes it: through
    ``formats.mul`` on CPU, which flushes subnormals, and as plain FP32 multiplies in the
    same order on CUDA, which keeps them (XLA's GPU default): there each multiply is the
    one IEEE rounding the contract names, a subnormal factor or result included. On a GPU
    the plain form is a few multiplies that XLA fuses into the result's consumers, where
    ``formats.mul``'s selects over the whole result kept the scaling a kernel of its own
    (NVFP4's 8B layer on a GB200: four [tokens, F] passes, docs/plan_results.md)."""
    given = [f for f in factors if f is not None]
    if not given:
        return out
    return lax.platform_dependent(out, *given, default=apply_factors,
                                  cuda=functools.partial(apply_factors, mul=operator.mul))


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """The reference GEMM: contracts operands a and b in FP32 accumulation, applies both
    tensor factors to the FP32 result, casts to out_dtype. contracting: ((a_axis,), (b_axis,)).

    An RHT'd pair was zero-padded along M before the transform; since H is orthogonal the
    padded product equals the unpadded one, so nothing needs slicing here.
    """
    (ca,), (cb,) = contracting
    av, fa, ca = gemm_inputs(a, compute_dtype, ca)
    bv, fb, cb = gemm_inputs(b, compute_dtype, cb)
    out = f32_dot(av, ca, bv, cb)
    return apply_factors(out, fa, fb).astype(out_dtype)
