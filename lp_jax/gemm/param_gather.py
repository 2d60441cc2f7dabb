"""FSDP weight all-gathers of quantized bytes (Megatron's fp8_param_gather / fp4_param_gather).

Under ZeRO-3 each device quantizes its own shard of the FP32 master weight, and the
all-gather moves the quantized bytes and scales instead of the BF16 cast: the fprop copy in
the forward, the dgrad copy (kept sharded until then) in the backward. The codes are exactly
those of quantizing the gathered weight: blocks never straddle shards, and the tensor amax is
the max of the shards' amaxes. Low-precision arrays travel as uint8 bytes (FP4 codes two per
byte; docs/scaling.md). ``layout`` is the mesh spec of the kernel [K, N] (e.g. ("fsdp",
"tensor")); the gather runs in ``jax.shard_map`` over the mesh in context, along the
dimension on "fsdp".
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lp_jax.gemm.operands import quantize_kwargs, shares_bytes, weight_source
from lp_jax.numerics import formats as F
from lp_jax.numerics.manual_axes import max_over_devices
from lp_jax.numerics.quantize import abs_max, format_named
from lp_jax.quantizer import quantize

FSDP = "fsdp"


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def gathered_dim(layout) -> int:
    """The kernel dimension sharded over (only) the fsdp axis: the one the gather rebuilds."""
    dims = [d for d, entry in enumerate(layout) if entry == FSDP]
    if len(dims) != 1 or len(layout) != 2:
        raise ValueError(f"param_gather needs a 2-D kernel layout with one dimension on {FSDP!r} "
                         f"alone, got {layout}")
    return dims[0]


def _gathered_layout(layout):
    """The layout after the gather: the fsdp dimension whole, the other as it was."""
    return tuple(None if e == FSDP else e for e in layout)


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("param_gather needs the device mesh in context (jax.sharding.use_abstract_mesh "
                         "or jax.set_mesh), as the trainer's step sets it")
    return mesh


# ------------------------------------------------------------------- bytes on the wire


def _to_wire(a, pair_axis):
    """a as uint8 bytes: 1-byte formats bitcast, FP4 codes packed two per byte along pair_axis."""
    if a.dtype == F.E2M1:
        codes = lax.bitcast_convert_type(a, jnp.uint4).astype(jnp.uint8)
        lo, hi = (lax.slice_in_dim(codes, i, None, stride=2, axis=pair_axis) for i in (0, 1))
        return lo | (hi << 4)
    if jnp.dtype(a.dtype).itemsize == 1:
        return lax.bitcast_convert_type(a, jnp.uint8)
    return a


def _from_wire(b, dtype, pair_axis):
    if jnp.dtype(dtype) == jnp.dtype(F.E2M1):
        codes = jnp.stack([b & 0xF, b >> 4], axis=pair_axis + 1)  # each byte back to its pair
        shape = list(b.shape)
        shape[pair_axis] *= 2
        return lax.bitcast_convert_type(codes.reshape(shape).astype(jnp.uint4), F.E2M1)
    return lax.bitcast_convert_type(b, dtype) if b.dtype != dtype else b


def _all_gather(a, dim, axis=FSDP):
    """One tiled all-gather of a's local bytes along ``dim`` over mesh ``axis`` (scalars,
    the replicated tensor scales, are returned as they are)."""
    if a is None or a.ndim == 0:
        return a
    wire = lax.all_gather(_to_wire(a, dim), axis, axis=dim, tiled=True)
    return _from_wire(wire, a.dtype, dim)


def _gather_tree(q, dim, axis=FSDP):
    return jax.tree.map(partial(_all_gather, dim=dim, axis=axis), q)


# ------------------------------------------------------------------- local quantization


def _copies(recipe, wc, sharded_axes):
    """(fprop copy, dgrad copy) of the weight shard wc, quantized as the whole weight is:
    the tensor amax (FP8-CS, NVFP4) is reduced over the mesh axes that shard the weight."""
    fprop, dgrad = recipe.fprop_w, recipe.dgrad_w
    amax = None
    if format_named(fprop.fmt).tensor_scale or format_named(dgrad.fmt).tensor_scale:
        # Over every axis of the shard, not axis=None: the data axis holds the same weight, so
        # only the axes that shard it need the all-reduce below (manual_axes.tensor_amax would add data).
        amax = abs_max(wc, axis=tuple(range(wc.ndim)))
        if sharded_axes:
            amax = max_over_devices(amax, sharded_axes)  # one scalar all-reduce(max)
    fq = quantize(wc, fprop.fmt, axis=0, tensor_amax=amax, **quantize_kwargs(fprop))
    if shares_bytes(fprop, dgrad):  # per-tensor FP8, NVFP4's 16x16 tiles: one copy for both
        return fq, fq
    return fq, quantize(wc, dgrad.fmt, axis=1, tensor_amax=amax, **quantize_kwargs(dgrad))


def _size(mesh, entry) -> int:
    size = 1
    for name in _axes(entry):
        size *= mesh.shape[name]
    return size


def _split_block(recipe, local_shape, global_shape):
    """(format, block, axis) of the first block of the weight's copies that a shard of
    ``local_shape`` splits, or None when every shard holds whole blocks."""
    for spec, axis in ((recipe.fprop_w, 0), (recipe.dgrad_w, 1)):
        block = format_named(spec.fmt).block
        for a in ((0, 1) if spec.block_2d else (axis,)):
            if block and local_shape[a] != global_shape[a] and local_shape[a] % block:
                return spec.fmt, block, a
    return None


def keeps_whole_blocks(recipe, local_shape, global_shape) -> bool:
    """Whether a shard of ``local_shape`` of the weight holds whole blocks of both copies."""
    return _split_block(recipe, local_shape, global_shape) is None


def _check_whole_blocks(recipe, local_shape, global_shape):
    """A block split across shards would get other scales than the unsharded recipe's: refuse
    (the trainer's mesh checks reject such meshes before compiling, with the layer's name)."""
    split = _split_block(recipe, local_shape, global_shape)
    if split:
        fmt, block, a = split
        raise ValueError(f"param_gather: a weight {global_shape} sharded to {local_shape} splits "
                         f"{fmt} blocks of {block} along axis {a}")


def _specs(tree, layout):
    """shard_map specs of a QuantizedTensor tree: arrays laid out like the weight (block
    scales follow their data), scalars (tensor scales) replicated."""
    return jax.tree.map(lambda s: P() if s.ndim == 0 else P(*layout), tree)


def applies(recipe, layout) -> bool:
    """Whether the quantized gather runs: a layout is set and both weight copies are quantized."""
    return (layout is not None and recipe.param_gather and recipe.fprop_w.fmt is not None
            and recipe.dgrad_w.fmt is not None)


def forward(recipe, layout, w, compute_dtype):
    """(gathered fprop operand, dgrad residual sharded like w) of the FP32 kernel w [K, N].

    Each device quantizes its shard of the master (``operands.weight_source``: the FP32
    master itself with ``recipe.param_gather``, else its cast to compute_dtype), and only the
    fprop copy is gathered here; the dgrad copy stays sharded until the backward
    (``backward``)."""
    mesh = _mesh()
    dim = gathered_dim(layout)
    sharded_axes = tuple(a for e in layout for a in _axes(e))
    local = jax.ShapeDtypeStruct(tuple(n // _size(mesh, e) for n, e in zip(w.shape, layout)), w.dtype)
    _check_whole_blocks(recipe, local.shape, w.shape)
    source = lambda w_local: weight_source(recipe, w_local, compute_dtype)  # noqa: E731
    fq_shape, dq_shape = jax.eval_shape(lambda t: _copies(recipe, source(t), ()), local)

    def body(w_local):
        fq, dq = _copies(recipe, source(w_local), sharded_axes)
        return _gather_tree(fq, dim), dq

    out_specs = (_specs(fq_shape, _gathered_layout(layout)), _specs(dq_shape, layout))
    return jax.shard_map(body, mesh=mesh, in_specs=P(*layout), out_specs=out_specs,
                         check_vma=False)(w)


def backward(layout, dq):
    """The dgrad operand: the sharded copy ``forward`` returned, gathered."""
    dim = gathered_dim(layout)
    # Without the barrier XLA may merge this gather with the forward's (FP8-CS and NVFP4
    # gather the same bytes twice) and keep the whole weight alive from forward to backward.
    dq = lax.optimization_barrier(dq)
    return jax.shard_map(lambda q: _gather_tree(q, dim), mesh=_mesh(), in_specs=(_specs(dq, layout),),
                         out_specs=_specs(dq, _gathered_layout(layout)), check_vma=False)(dq)


def gathered_copies(recipe, w_shard, compute_dtype, dim: int, axis: str):
    """(fprop copy, dgrad copy, None where the fprop bytes serve both) of a kernel [K, N] of
    which this device holds the shard ``w_shard`` along ``dim`` over mesh ``axis``, called
    inside a shard_map manual over ``axis`` (ZeRO-1's data axis): quantized as the whole
    kernel is (its tensor amax maxed over ``axis``), then its bytes and scales all-gathered."""
    fq, dq = _copies(recipe, weight_source(recipe, w_shard, compute_dtype), (axis,))
    if shares_bytes(recipe.fprop_w, recipe.dgrad_w):
        return _gather_tree(fq, dim, axis), None
    return _gather_tree(fq, dim, axis), _gather_tree(dq, dim, axis)
