"""Logical activation sharding for the model: a no-op unless a trainer asks for it.

The model names the axes of a few activations (``batch``, ``sequence``, ``embed``,
``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``), as MaxText does with
``nn.with_logical_constraint``; a trainer maps those names to mesh axes with Flax's
``nnx.logical_axis_rules(rules)`` and a mesh context (``jax.set_mesh`` outside jit,
``jax.sharding.use_abstract_mesh`` inside). Without both, ``constrain`` returns its input,
so single-device code, inference and the HF tests see no change. Nothing here knows
about precision, and no state is added.
"""
from __future__ import annotations

import math

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec as P


def _mesh_size(mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def constrain(x, logical_axes: tuple[str | None, ...]):
    """``x`` with a sharding constraint from the logical axis names (one per dimension).

    A name without a rule, or whose mesh axes do not divide that dimension, is left
    unsharded (a short last micro-batch or a small test model must still compile).
    """
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    table = dict(rules)
    spec = []
    for dim, name in zip(x.shape, logical_axes, strict=True):
        entry = table.get(name) if name is not None else None
        if entry is not None and (not all(n in mesh.shape for n in _names(entry))
                                  or dim % _mesh_size(mesh, entry)):
            entry = None
        spec.append(entry)
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _names(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)

