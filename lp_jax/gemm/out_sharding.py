"""``out_sharding`` for the quantized dot_general, under Auto and Explicit meshes.

``nnx.Linear`` passes ``out_sharding``, which ``lax.dot_general`` would honour; the
quantized GEMM honours it around its whole computation. On Auto mesh axes the result gets a
``with_sharding_constraint`` (``reshard`` and ``dot_general(..., out_sharding=)`` reject Auto
axes). On Explicit axes the GEMM runs inside ``jax.sharding.auto_axes`` over them, so the
partitioner places the quantization and the collectives (a block quantizer's reshapes have
no single "typed" answer), and the result is typed with ``out_sharding`` or, when none is
given, as ``lax.dot_general`` would type it; the cotangents come back typed like the primal
inputs. Without a mesh and without ``out_sharding`` nothing is added.
"""
from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _typed_mesh(*arrays):
    """The mesh in the context, else the one in the operands' types (Explicit arrays)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for a in arrays:
        m = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if m is not None and not m.empty:
            return m
    return None


def _spec(a) -> tuple:
    spec = tuple(getattr(getattr(jax.typeof(a), "sharding", None), "spec", ()) or ())
    return spec + (None,) * (a.ndim - len(spec))


def default_out_spec(lhs, rhs, dimension_numbers) -> P:
    """The spec lax.dot_general gives an Explicit result: the free dimensions of lhs, then
    of rhs, keep their shardings (a mesh axis already used keeps its first place)."""
    (lc, rc), _ = dimension_numbers
    lc, rc = {a % lhs.ndim for a in lc}, {a % rhs.ndim for a in rc}
    entries, used = [], set()
    for operand, contracted in ((lhs, lc), (rhs, rc)):
        for axis, entry in enumerate(_spec(operand)):
            if axis in contracted:
                continue
            names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            if used & set(names):
                entry = None
            used |= set(names) if entry is not None else set()
            entries.append(entry)
    return P(*entries)


def with_out_sharding(compute, lhs, rhs, dimension_numbers, out_sharding):
    """``compute(lhs, rhs)`` with its result sharded as ``out_sharding`` (see the module)."""
    mesh = _typed_mesh(lhs, rhs)
    explicit = () if mesh is None else tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
    if explicit:
        if out_sharding is None:
            out_sharding = default_out_spec(lhs, rhs, dimension_numbers)
        if isinstance(out_sharding, P) and jax.sharding.get_abstract_mesh().empty:
            out_sharding = NamedSharding(mesh, out_sharding)
        return jax.sharding.auto_axes(compute, axes=explicit, out_sharding=out_sharding)(lhs, rhs)
    y = compute(lhs, rhs)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y
