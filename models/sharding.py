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
from jax.sharding import AxisType
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
    spec = [_entry(table, name, dim, mesh, mesh.shape)
            for dim, name in zip(x.shape, logical_axes, strict=True)]
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _entry(table, name, dim: int, mesh, axes):
    """The mesh axes logical ``name`` splits a dimension of length ``dim`` over: its rule's,
    when they are all among ``axes`` and divide ``dim``; else None (left whole)."""
    entry = table.get(name) if name is not None else None
    if entry is None or not all(n in axes for n in axis_names(entry)) or dim % mesh_size(mesh, entry):
        return None
    return entry


def per_device(fn, args, in_axes, out_axes, together=()):
    """``fn(*args)`` run on each device's pieces: a ``shard_map`` over the mesh axes not
    already manual, each argument and the result split by logical names (one per dimension)
    as ``constrain`` would split them. For calls that must not be left to the partitioner.

    A name that cannot split one of its dimensions (no rule, or axes that do not divide it)
    splits none; ``together`` lists groups of names that split all together or not at all.
    Without rules and a mesh in context this is ``fn(*args)``.
    """
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return fn(*args)
    auto = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
    if not auto:
        return fn(*args)
    table = dict(rules)
    blocked = set()
    for arg, names in zip(args, in_axes, strict=True):
        for dim, name in zip(arg.shape, names, strict=True):
            if table.get(name) is not None and _entry(table, name, dim, mesh, auto) is None:
                blocked.add(name)
    for group in together:
        if blocked & set(group):
            blocked |= set(group)

    def spec(names):
        return P(*(None if name is None or name in blocked else table.get(name) for name in names))

    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(n) for n in in_axes), out_specs=spec(out_axes),
                         axis_names=auto, check_vma=False)(*args)
