"""The embedding lookup ``jnp.take(table, tokens, axis=0)``, vocabulary-parallel where a
trainer asks for it: Megatron's VocabParallelEmbedding written with explicit collectives.

A trainer names the mesh axes that split the table's vocabulary with the logical rule
``lookup_vocab``; the lookup is then a ``shard_map`` manual over those axes and the tokens'
axes, equal to ``jnp.take`` bit for bit, whose backward scatter-adds each rank's row gradients
into its slice and sums them in FP32. Without the rule, or without a mesh, it is ``jnp.take``.
Why and how: docs/models.md, "Vocabulary-parallel embedding lookup".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from models.sharding import axis_names, mesh_size

RULE = "lookup_vocab"


def embedding_lookup(table, tokens):
    """The rows of ``table`` [V, D] at ``tokens`` (integers, any shape): ``tokens.shape + (D,)``."""
    plan = _plan(table, tokens.shape)
    if plan is None:
        return jnp.take(table, tokens, axis=0)
    return _vocab_parallel(table, tokens, plan)


def _plan(table, token_shape: tuple[int, ...]):
    """(vocabulary axes, token axes, table shape, table dtype name) for the shard_map (static:
    the custom VJP's backward reads them), or None for a plain take: no rule, no mesh, or the
    vocabulary axes do not split the table evenly."""
    vocab = table.shape[0]
    rules = dict(spmd.get_logical_axis_rules() or ())
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not rules.get(RULE):
        return None
    # Axes a shard_map may take (not manual already), leaving out those of size 1: a
    # collective over one device still moves its operand (a reduce-scatter of the whole
    # table gradient on 8x1x8).
    auto = {n for n, t in zip(mesh.axis_names, mesh.axis_types)
            if t != AxisType.Manual and mesh.shape[n] > 1}
    vocab_axes = tuple(n for n in axis_names(rules[RULE]) if n in auto)
    size = mesh_size(mesh, vocab_axes)
    if size <= 1 or vocab % size:
        return None
    # The tokens' leading (batch) dimension split as the rules split "batch", when it divides.
    token_axes = tuple(n for n in axis_names(rules.get("batch")) if n in auto and n not in vocab_axes)
    if not token_shape or not token_axes or token_shape[0] % mesh_size(mesh, token_axes):
        token_axes = ()
    return vocab_axes, token_axes, tuple(table.shape), jnp.dtype(table.dtype).name


def _specs(plan, ndim: int):
    vocab_axes, token_axes = plan[:2]
    table = P(vocab_axes, None)
    tokens = P(token_axes or None, *([None] * (ndim - 1)))
    rows = P(token_axes or None, *([None] * ndim))
    return table, tokens, rows


def _local(ids, vocab_axes, local_vocab: int):
    """This rank's row index of each token, and whether the token falls in its slice."""
    local = ids - lax.axis_index(vocab_axes) * local_vocab
    inside = (local >= 0) & (local < local_vocab)
    return jnp.where(inside, local, 0), inside


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _vocab_parallel(table, tokens, plan):
    return _forward(table, tokens, plan)


def _forward(table, tokens, plan):
    vocab_axes, token_axes = plan[:2]
    table_spec, tokens_spec, rows_spec = _specs(plan, tokens.ndim)
    bits = jnp.dtype(f"int{8 * jnp.dtype(table.dtype).itemsize}")  # the same width as the rows

    def body(table, tokens):
        index, inside = _local(tokens, vocab_axes, table.shape[0])
        rows = jnp.take(table, index, axis=0)
        rows = lax.bitcast_convert_type(rows, bits)
        rows = jnp.where(inside[..., None], rows, jnp.zeros((), bits))
        return lax.bitcast_convert_type(lax.psum(rows, vocab_axes), table.dtype)

    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(body, mesh=mesh, in_specs=(table_spec, tokens_spec), out_specs=rows_spec,
                         axis_names=frozenset({*vocab_axes, *token_axes}), check_vma=False)(table, tokens)


def _fwd(table, tokens, plan):
    return _forward(table, tokens, plan), tokens


def _bwd(plan, tokens, grad_rows):
    vocab_axes, token_axes, table_shape, table_dtype = plan
    _, tokens_spec, rows_spec = _specs(plan, tokens.ndim)
    mesh = jax.sharding.get_abstract_mesh()
    local_vocab = table_shape[0] // mesh_size(mesh, vocab_axes)
    hidden = table_shape[1]
    # The token ranks' partial gradients are summed by a reduce-scatter along the hidden
    # dimension where it divides (the parameter is split that way over fsdp), else psum.
    scatter = bool(token_axes) and hidden % mesh_size(mesh, token_axes) == 0

    def body(tokens, grad_rows):
        index, inside = _local(tokens, vocab_axes, local_vocab)
        grad_rows = jnp.where(inside[..., None], grad_rows, jnp.zeros((), grad_rows.dtype))
        grad = jnp.zeros((local_vocab, hidden), grad_rows.dtype)
        grad = grad.at[index.reshape(-1)].add(grad_rows.reshape(-1, hidden))
        if scatter:
            return lax.psum_scatter(grad, token_axes, scatter_dimension=1, tiled=True)
        return lax.psum(grad, token_axes) if token_axes else grad

    table_spec = P(vocab_axes, token_axes if scatter else None)
    grad = jax.shard_map(body, mesh=mesh, in_specs=(tokens_spec, rows_spec), out_specs=table_spec,
                         axis_names=frozenset({*vocab_axes, *token_axes}),
                         check_vma=False)(tokens, grad_rows.astype(table_dtype))
    return grad, None


_vocab_parallel.defvjp(_fwd, _bwd)
