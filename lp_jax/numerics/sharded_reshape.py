"""Reshapes that split or merge one axis, carrying an explicit sharding along.

Under an Explicit mesh a reshape of a sharded axis must name its output sharding. Splitting
an axis into (blocks, block) keeps the shards on the blocks axis, so a block never straddles
two shards (the caller checks divisibility before training); merging puts them back. Under
Auto meshes or without a mesh these are plain reshapes.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _explicit_spec(x):
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()) or mesh.empty:
        return None, None
    explicit = any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if not explicit or all(s is None for s in spec):
        return None, None
    return mesh, spec


def split_axis(x, axis, sizes):
    """Reshapes axis ``axis`` of x into ``sizes`` (the first new axis keeps its sharding)."""
    axis = axis % x.ndim
    shape = x.shape[:axis] + tuple(sizes) + x.shape[axis + 1:]
    mesh, spec = _explicit_spec(x)
    if mesh is None:
        return x.reshape(shape)
    if spec[axis] is not None and sizes[0] % _shard_count(mesh, spec[axis]):
        # Blocks would straddle shards: gather this axis first (correct, costs a collective;
        # a training mesh that would split blocks is rejected before compiling instead).
        spec = spec[:axis] + (None,) + spec[axis + 1:]
        x = jax.sharding.reshard(x, P(*spec))
    new_spec = spec[:axis] + (spec[axis],) + (None,) * (len(sizes) - 1) + spec[axis + 1:]
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, P(*new_spec)))


def _shard_count(mesh, entry):
    names = entry if isinstance(entry, tuple) else (entry,)
    count = 1
    for name in names:
        count *= mesh.shape[name]
    return count


def merge_axes(x, axis, count):
    """Merges axes axis .. axis+count-1 of x into one (sharded like the first of them)."""
    axis = axis % x.ndim
    merged = 1
    for d in x.shape[axis:axis + count]:
        merged *= d
    shape = x.shape[:axis] + (merged,) + x.shape[axis + count:]
    mesh, spec = _explicit_spec(x)
    if mesh is None:
        return x.reshape(shape)
    new_spec = spec[:axis] + (spec[axis],) + spec[axis + count:]
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, P(*new_spec)))
