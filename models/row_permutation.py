"""Gathers of rows that move each row to at most one place (the expert-parallel dispatch's
permutations: sorted rows into the send buffers, received rows into the grouped layout, and
back), with a backward that gathers too.

Autodiff transposes a gather into a scatter-add over the whole source buffer, which XLA's
GPU compiler runs as a kernel that reads and writes that buffer (the worst-case buffers of
the dispatch are ``ep`` times the routed rows). A row that went to one place gets its
cotangent from that one place: the backward gathers it with the inverse map, which the
dispatch computes anyway. Every cotangent element is the one the scatter-add would add to a
zero, so the gradients are the same values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def gather_rows(x, index, inverse):
    """``x[index]``, a zero row where ``index`` is out of range (``len(x)`` or more).

    ``index`` [n] must be injective on its in-range entries and ``inverse`` [len(x)] its
    inverse: ``inverse[index[i]] == i`` for every in-range ``index[i]``, and ``inverse[j]``
    out of range (``n`` or more) for every row ``j`` of ``x`` that no ``index[i]`` names.
    Its transpose is then ``gather_rows(dy, inverse, index)``."""
    return _gather(x, index)


def _gather(x, index):
    rows = x.shape[0]
    valid = (index < rows).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(valid, x[jnp.minimum(index, rows - 1)], 0).astype(x.dtype)


def _gather_rows_fwd(x, index, inverse):
    return _gather(x, index), (index, inverse)


def _gather_rows_bwd(res, dy):
    index, inverse = res
    return gather_rows(dy, inverse, index), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
