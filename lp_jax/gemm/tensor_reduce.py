"""Tensor-parallel GEMMs whose contraction is split over ``tensor``, reduced in BF16 on the wire.

Under Megatron tensor parallelism two GEMMs of a layer contract over a dimension split across
the ``tensor`` ranks, so each rank holds a partial sum of the result:

- the forward (fprop) of a row-parallel layer (o_proj, down_proj: kernel [K, N] with K on
  ``tensor``);
- the backward (dgrad) of a column-parallel layer (q/k/v/gate/up, the LM head: N on
  ``tensor``).

Left to the partitioner, those partials are all-reduced in FP32 (the GEMM's accumulator)
before the cast to the activation dtype. Megatron all-reduces them in BF16. Here, inside a
``jax.shard_map`` manual over ``tensor`` and the axes that split the tokens, each rank
computes its FP32 partial and reduces it as a reduce-scatter followed by an all-gather,
written with collectives that do no arithmetic:

1. the partial [M, N] is cast to the output dtype (BF16) and split along N into one chunk
   per rank; ``all_to_all`` sends chunk r to rank r (the reduce-scatter's bytes);
2. each rank adds the chunks it received in FP32, in rank order (the same order on every
   rank and every step: deterministic), and casts the sum to BF16 once;
3. ``all_gather`` (BF16) rebuilds the whole result on every rank.

The wire carries BF16, as a BF16 ring all-reduce does (half of FP32's bytes), but the sum
is FP32: each partial is rounded to BF16 once (relative error <= 2^-9 of that partial),
where a BF16 ring rounds after every hop. And no collective adds BF16 values, which XLA:CPU
cannot compile ("Invalid binary instruction opcode copy"), so it is tested here.

Operands are quantized before the shard_map, by the partitioner's program (global
per-tensor amaxes, stochastic-rounding bits indexed by the global element), exactly as
without this path; inside, each rank runs the backend's GEMM on its whole blocks (the
mesh checks guarantee no block straddles ranks), so only the reduction differs.
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
    the shard_map are gathered whole on every rank (measured: 1x4x2 moved 4x the bytes)."""
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
