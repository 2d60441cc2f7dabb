"""How XLA splits the wgmma backend's GEMM over a mesh: a Pallas kernel brings no
partitioning rule of its own, and XLA would otherwise feed it whole, replicated operands.

The GEMM is out [M, N] = a [M, K] x b [N, K]^T with scales [M, K/128] and [N, K/128]. Rows
of a (tokens) and rows of b (output features) split as they come, each with its scales, and
the result is split by both; K is gathered (a sharded contraction would need the partial
sums reduced, and its 128-blocks need not align with the shards). A mesh axis that splits
both M and N keeps M's split. Each device runs the kernel on its own rows.
"""
from __future__ import annotations

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _rows_axes(shape):
    spec = shape.sharding.spec
    return spec[0] if len(spec) else None


def _names(entry) -> set:
    return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def _split(arg_shapes):
    """(mesh axes of M, of N) from the operands' shardings."""
    m, n = _rows_axes(arg_shapes[0]), _rows_axes(arg_shapes[2])
    return m, (None if _names(m) & _names(n) else n)


def partitioned(local):
    """``local(a, a_scales, b, b_scales) -> out`` as an op XLA partitions as above."""
    op = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shape):
        m, n = _split(arg_shapes)
        rows = lambda axes: NamedSharding(mesh, PartitionSpec(axes, None))  # noqa: E731
        return mesh, local, NamedSharding(mesh, PartitionSpec(m, n)), (rows(m), rows(m), rows(n), rows(n))

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(*_split(arg_shapes)))

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="m k, m l, n k, n l -> m n", need_replication_factors=("k", "l"))
    return op
