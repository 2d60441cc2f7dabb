"""Expert parallelism for ``models.moe``: the experts split over a mesh axis, each routed row
sent to the rank that holds its expert and its result sent back, by all-to-all.

The mesh axis is the one the ``expert`` logical rule names (``lp_jax.parallel.partitioning``
maps it to the mesh's ``expert`` axis); without rules and a mesh in context, or where that
axis has one device, the MoE layer runs every expert on its own rows and nothing here is
used. Otherwise the layer's dispatch, grouped GEMMs and combine run in a ``shard_map``
manual over every axis the partitioner still owns (the grouped GEMMs then see plain
per-device arrays, as on one device): tokens split over the batch axes, each device holding
``E / ep`` whole experts (``E`` experts, ``ep`` expert ranks).

Dropless, with fixed-size buffers: a device sends each expert rank a buffer of
``capacity = tokens x min(k, E / ep)`` rows (every routed row of its tokens could go to one
rank, and a token's k experts are distinct), so no row is ever dropped, and receives ``ep``
such buffers. ``jax.lax.all_to_all`` moves the buffers both ways (it runs on XLA:CPU and on
GPUs, and is differentiable: its transpose is the reverse all-to-all).
``jax.lax.ragged_all_to_all`` would move only the routed rows, but XLA:CPU cannot run it
("HLO opcode ragged-all-to-all is not supported", JAX 0.11.2 and 0.12.1), so the CPU tests
could not check it.

The rows move between layouts by gathers that place each row at most once (sorted rows into
the send buffers, received rows into the grouped layout, and both back): their backward
gathers with the inverse map (``models.row_permutation``) rather than scatter-adding over
the worst-case buffers.

Each receiving device orders its rows by local expert, then by source rank, then as the
source sent them (token order): with the batch split over expert ranks in order, expert
``e``'s rows are exactly the rows one device running the whole batch groups for ``e``, in
the same order, so the grouped GEMM quantizes each expert's rows as it would there (its
blocks along the tokens, its tensor scale, its stochastic-rounding key: ``first_group``
gives the global expert index).

The dispatch may travel encoded (``codec``, set on the MoE layer by the trainer: lp_jax's
FP8 dispatch, ``mesh.ep_dispatch_dtype=fp8``): the rows leave as ``codec.encode(rows)``, one
array that packs the low-precision values and their scales, so one all-to-all moves both,
and arrive as ``codec.decode(packed, D, dtype)``. The backward moves the dispatched rows'
cotangent in the activation dtype, the quantize-dequantize taken as the identity (a
straight-through estimator, as DeepSeek-V3 sends its dispatch gradient in BF16); the
combine moves the experts' outputs in the activation dtype both ways.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from models.row_permutation import gather_rows


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def expert_axis() -> str | None:
    """The mesh axis the experts are split over here, or None (no rules or mesh in context,
    or an axis of one device): the ``expert`` rule's axis."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return None
    axes = _axes(dict(rules).get("expert"))
    if len(axes) != 1 or axes[0] not in mesh.axis_names or mesh.shape[axes[0]] == 1:
        return None
    if dict(zip(mesh.axis_names, mesh.axis_types))[axes[0]] == AxisType.Manual:
        raise ValueError(f"the MoE layer splits its experts over mesh axis {axes[0]!r} itself; it "
                         "cannot run inside a shard_map already manual over that axis")
    return axes[0]


def batch_sum(x):
    """``x`` summed over the mesh axes that are manual here and split the batch (the
    ``global_batch`` rule's): a statistic of this device's rows becomes the whole batch's.
    Axes the partitioner owns need nothing (its arrays are already whole)."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    axes = tuple(a for a in _axes(dict(rules).get("global_batch"))
                 if types.get(a) == AxisType.Manual and mesh.shape[a] > 1)
    return lax.psum(x, axes) if axes else x


def sorted_by_expert(experts_TxK):
    """(order, token_of_row) of a device's routed rows sorted by expert (``order``: the
    flat [T*k] indices in that order; stable, so a token's rows stay in token order)."""
    order = jnp.argsort(experts_TxK.reshape(-1), stable=True)
    return order, order // experts_TxK.shape[1]


def combine(y_rows, order, token_of_row, weights_TxK, tokens: int):
    """Each token's output [T, D] (FP32): its rows' results (sorted as ``sorted_by_expert``
    gives them) weighted by their routing weights and summed."""
    return jnp.zeros((tokens, y_rows.shape[-1]), jnp.float32).at[token_of_row].add(
        y_rows.astype(jnp.float32) * weights_TxK.reshape(-1)[order][:, None])


def expert_parallel(run_experts, x_TxD, weights_TxK, experts_TxK, kernels, num_experts: int, axis: str,
                    codec=None):
    """The routed MLP's output [T, D] (FP32) with the experts split over mesh ``axis``.

    ``run_experts(rows [M, D], group_sizes [E / ep], kernels, first_group, expected_rows)``
    runs the local experts' grouped GEMMs on rows sorted by local expert (``kernels``: this
    rank's slices, [E / ep, ...] each; ``first_group``: the global index of its first expert;
    ``expected_rows``: the rows of the worst-case M that even routing fills).
    ``kernels``: the experts' whole kernels [E, ...], split over ``axis`` on entry.
    ``codec``: None (the dispatch moves the rows as they are) or an encoding of the
    dispatched rows (``send_rows``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    table = dict(spmd.get_logical_axis_rules())
    auto = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
    rows_over = tuple(a for a in _axes(table.get("batch")) if a in auto)
    if axis not in rows_over:
        raise ValueError(f"expert parallelism needs the batch split over mesh axis {axis!r} "
                         f"(the batch rule names {rows_over})")
    split = math.prod(mesh.shape[a] for a in rows_over)
    ep = mesh.shape[axis]
    if num_experts % ep:
        raise ValueError(f"mesh axis {axis!r} of {ep} devices does not divide the {num_experts} experts")
    if x_TxD.shape[0] % split:
        raise ValueError(f"the MoE layer's {x_TxD.shape[0]} tokens do not split over mesh axes "
                         f"{' x '.join(rows_over)} ({split} devices)")
    rows = P(rows_over)

    def local(x, weights, experts, kernels):
        return _dispatch_run_combine(run_experts, x, weights, experts, kernels, num_experts, axis, ep, codec)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(rows, rows, rows, tuple(P(axis) for _ in kernels)), out_specs=rows,
        axis_names=set(auto), check_vma=False)(x_TxD, weights_TxK, experts_TxK, tuple(kernels))


def send_rows(rows, axis: str, codec=None):
    """``rows`` [ep, capacity, D] all-to-all over mesh ``axis`` (buffer r to rank r).

    With a ``codec``, the forward moves ``codec.encode(rows)`` (values and scales packed in
    one array) and returns ``codec.decode(received, D, rows.dtype)``; the backward moves the
    cotangent as it comes, in the activation dtype: the quantize-dequantize is taken as the
    identity (straight-through)."""
    if codec is None:
        return lax.all_to_all(rows, axis, 0, 0)
    return _send_encoded(codec, axis, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_encoded(codec, axis, rows):
    received = lax.all_to_all(codec.encode(rows), axis, 0, 0)
    return codec.decode(received, rows.shape[-1], rows.dtype)


def _send_encoded_fwd(codec, axis, rows):
    return _send_encoded(codec, axis, rows), None


def _send_encoded_bwd(codec, axis, _, d_received):
    # all_to_all over the leading axis is its own transpose: buffer r goes back to rank r.
    return (lax.all_to_all(d_received, axis, 0, 0),)


_send_encoded.defvjp(_send_encoded_fwd, _send_encoded_bwd)


def _dispatch_run_combine(run_experts, x_TxD, weights_TxK, experts_TxK, kernels, num_experts, axis, ep,
                          codec=None):
    """One device's part: its tokens' rows to their experts' ranks, this rank's experts on
    the rows it received, the results back, weighted and summed per token."""
    tokens, k = experts_TxK.shape
    d = x_TxD.shape[1]
    per_rank = num_experts // ep
    capacity = tokens * min(k, per_rank)

    # This device's routed rows sorted by expert, so the rows bound for each rank are
    # consecutive.
    flat = experts_TxK.reshape(-1)
    order, token_of_row = sorted_by_expert(experts_TxK)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32).reshape(ep, per_rank)
    send = jnp.sum(counts, axis=1)
    send_start = jnp.cumsum(send) - send
    slot = jnp.arange(capacity)
    # Slot s of buffer r holds sorted row send_start[r] + s, or nothing (tokens * k);
    # sorted row i sits in buffer rank_of_row[i] at slot_of_row[i].
    in_buffer = slot[None, :] < send[:, None]  # [ep, capacity]
    source_row = jnp.where(in_buffer, send_start[:, None] + slot[None, :], tokens * k).reshape(-1)
    rank_of_row = flat[order] // per_rank
    slot_of_row = jnp.arange(tokens * k) - send_start[rank_of_row]
    buffer_row = rank_of_row * capacity + slot_of_row
    outgoing = gather_rows(x_TxD[token_of_row], source_row, buffer_row).reshape(ep, capacity, d)

    incoming = send_rows(outgoing, axis, codec)  # [source rank, capacity, D]
    got = lax.all_to_all(counts, axis, 0, 0)  # [source rank, local expert]: rows received

    # Where each received row goes in the grouped layout (local expert, source rank, order).
    start_in_buffer = jnp.cumsum(got, axis=1) - got  # of (source, expert) in its buffer
    group = jnp.sum(got, axis=0)
    group_start = jnp.cumsum(group) - group
    from_earlier_sources = jnp.cumsum(got, axis=0) - got
    ends = start_in_buffer + got
    expert_of = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1)  # [ep, capacity]
    received = expert_of < per_rank
    e = jnp.minimum(expert_of, per_rank - 1)
    pick = lambda table: jnp.take_along_axis(table, e, axis=1)  # noqa: E731
    rows_total = ep * capacity
    dest = (group_start[e] + pick(from_earlier_sources) + slot[None, :] - pick(start_in_buffer))
    dest = jnp.where(received, dest, rows_total).reshape(-1)
    # The inverse permutation, so that both directions are gathers.
    source_of = jnp.full((rows_total,), rows_total, jnp.int32).at[dest].set(
        jnp.arange(rows_total, dtype=jnp.int32), mode="drop")
    grouped = gather_rows(incoming.reshape(rows_total, d), source_of, dest)

    first_group = lax.axis_index(axis) * per_rank
    # Under even routing a rank receives as many rows as it sends (tokens x k), 1/ep of the
    # worst case when k <= E / ep: the plan costs the expert GEMMs for those.
    out_rows = run_experts(grouped.astype(x_TxD.dtype), group, kernels, first_group, tokens * k)

    back = gather_rows(out_rows, dest, source_of)
    returned = lax.all_to_all(back.reshape(ep, capacity, -1), axis, 0, 0)

    # Row i of this device's sorted rows came back from rank r at slot i - send_start[r].
    rows_back = gather_rows(returned.reshape(rows_total, -1), buffer_row, source_row)
    return combine(rows_back, order, token_of_row, weights_TxK, tokens)
