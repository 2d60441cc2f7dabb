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


def axis_names(entry) -> tuple[str, ...]:
    """The mesh axes a rule entry names: None, one name, or a tuple (or list) of names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def mesh_size(mesh, entry) -> int:
    """How many devices the axes of a rule entry span together (1 for none)."""
    return math.prod(mesh.shape[n] for n in axis_names(entry))


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
        if entry is not None and (not all(n in mesh.shape for n in axis_names(entry))
                                  or dim % mesh_size(mesh, entry)):
            entry = None
        spec.append(entry)
    return jax.lax.with_sharding_constraint(x, P(*spec))

