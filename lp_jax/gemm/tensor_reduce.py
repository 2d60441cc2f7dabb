"""Tensor-parallel GEMMs whose contraction is split over ``tensor``, reduced in BF16 on the wire.

The fprop of a row-parallel layer and the dgrad of a column-parallel one leave each
``tensor`` rank with an FP32 partial sum. Inside a ``jax.shard_map`` manual over ``tensor``
and the token axes, each rank casts its partial to the output dtype (BF16), sends chunk r to
rank r (``all_to_all``), adds the chunks it received in FP32 in rank order (the same on every
rank and step) and casts the sum once; ``all_gather`` rebuilds the result. BF16 bytes on the
wire, an FP32 sum, and no collective that adds BF16 values. Operands are quantized before
the shard_map, exactly as without this path, so only the reduction differs (docs/scaling.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from lp_jax.gemm.operands import Pending, Transposed, stored

TENSOR = "tensor"


def applies(kind: str | None, gemm_kind: str) -> bool:
    """Whether the GEMM reducing over tensor in a ``gemm_kind`` layer ("row": fprop, "column":
    dgrad) runs here: the Linear is marked ``kind`` and a tensor axis > 1 is in context."""
    if kind != gemm_kind:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.shape.get(TENSOR, 1) > 1


def reduce_partials(partial, out_dtype, axis_size: int):
    """The sum over ``tensor`` of each rank's FP32 ``partial`` [M, N], as ``out_dtype``:
    ``out_dtype`` on the wire, FP32 addition in rank order (call inside a shard_map manual
    over ``tensor``). N is zero-padded to a multiple of the axis size (exact)."""
    m, n = partial.shape
    pad = -n % axis_size
    wire = jnp.pad(partial, ((0, 0), (0, pad))).astype(out_dtype)
    chunk = (n + pad) // axis_size
    chunks = wire.reshape(m, axis_size, chunk).transpose(1, 0, 2)  # [rank to send to, M, chunk]
    received = lax.all_to_all(chunks, TENSOR, split_axis=0, concat_axis=0, tiled=True)
    total = received[0].astype(jnp.float32)
    for r in range(1, axis_size):  # rank order, fixed: the same rounding on every step
        total = total + received[r].astype(jnp.float32)
    whole = lax.all_gather(total.astype(out_dtype), TENSOR, axis=1, tiled=True)
    return whole[:, :n]


def _packed(op):
    """A Pending operand quantized here, outside the shard_map, into the bytes every
    backend reads (the same values: operands.gemm_inputs does the same for Pallas)."""
    return stored(op.t, op.spec, op.axis, op.key) if isinstance(op, Pending) else op


def _spec(op, axis: int, free):
    """shard_map specs of a 2-D GEMM operand contracted over ``axis``: arrays (data, block
    scales) split over tensor on that axis and over ``free`` on the other, scalars (tensor
    scales) replicated. A Transposed copy stores the operand transposed, so its contraction
    axis is the other one."""
    if isinstance(op, Transposed):
        return Transposed(_spec(op.q, 1 - axis, free))
    on = lambda leaf: P() if leaf.ndim == 0 else P(*(TENSOR if d == axis else free for d in range(leaf.ndim)))  # noqa: E731
    return jax.tree.map(on, op)


def _free_size(op, axis: int) -> int:
    """The length of a 2-D operand's non-contracted axis, whatever its representation."""
    if isinstance(op, Transposed):
        return op.q.data.shape[axis]
    return (op.data if hasattr(op, "data") else op).shape[1 - axis]


def _token_axes(mesh, tokens: int) -> tuple[str, ...]:
    """The mesh axes, other than tensor and those already manual (the trainer's data
    shard_map), that split the tokens (data and fsdp in the trainer), when they divide them.
    They are made manual too: left to the partitioner, the tokens of a collective inside
    the shard_map are gathered whole on every rank (docs/scaling.md)."""
    auto = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if n != TENSOR and t != AxisType.Manual]
    size = 1
    for n in auto:
        size *= mesh.shape[n]
    return tuple(auto) if auto and tokens % size == 0 else ()


def gemm(run, a, b, contracting, out_dtype):
    """``run(a, b, out_dtype)`` (the backend's GEMM of 2-D operands, contracted over
    ``contracting`` = ((a_axis,), (b_axis,)), both split over ``tensor``; a's other axis is
    the tokens) with its partial sums reduced as the module says. The result [M, N] is
    replicated over ``tensor``, its tokens split as the mesh's other axes split them."""
    mesh = jax.sharding.get_abstract_mesh()
    size = mesh.shape[TENSOR]
    (ca,), (cb,) = contracting
    a, b = _packed(a), _packed(b)
    tokens = _token_axes(mesh, _free_size(a, ca))
    free = tokens or None

    def body(a, b):
        return reduce_partials(run(a, b, jnp.float32), out_dtype, size)

    return jax.shard_map(body, mesh=mesh, in_specs=(_spec(a, ca, free), _spec(b, cb, None)),
                         out_specs=P(free, None), axis_names=frozenset({TENSOR, *tokens}),
                         check_vma=False)(a, b)
