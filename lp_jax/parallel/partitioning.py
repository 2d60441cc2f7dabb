"""Logical-axis rules: how parameters, optimizer state, gradients and activations are
sharded over the (data, fsdp, expert, tensor) mesh, in the Flax/MaxText convention.

Each tensor's dimensions get *logical* names and a rule table maps names to mesh axes.
Parameters (and, by the same path table, their Adam moments and gradients) are named by
``PARAM_AXES`` applied to the state, so the model carries no sharding metadata;
activations are named by the model (``models.sharding.constrain``) and mapped by
``ACTIVATION_RULES``. A dimension its mesh axes do not divide stays whole on them
(``sharding_report``), so any model compiles on any mesh. docs/scaling.md explains the
tables ("The sharding rules") and ZeRO-1's ``with_data_axis`` ("Communication at scale").
"""
from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lp_jax.parallel.mesh import BATCH_AXES

# Parameter path (searched in the '/'-joined path; a trailing '/value' is nnx.Variable's)
# -> logical names of its dimensions. Kernels are [in, out], as nnx.Linear stores them.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|/)embed/embedding$", ("vocab", "embed")),
    (r"(^|/)attn/q_proj/kernel$", ("embed", "heads")),
    (r"(^|/)attn/[kv]_proj/kernel$", ("embed", "kv_heads")),
    # Fused (models.fused_projections): qkv is laid out per KV group, so a split over whole
    # groups gives each tensor rank the q, k and v of its own heads.
    (r"(^|/)attn/qkv/kernel$", ("embed", "heads")),
    (r"(^|/)attn/o_proj/kernel$", ("heads", "embed")),
    (r"(^|/)mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"(^|/)mlp/gate_up/kernel$", ("embed", "mlp")),
    (r"(^|/)mlp/down_proj/kernel$", ("mlp", "embed")),
    # A mixture of experts (models.moe): the router [D, E] whole on every expert rank (FP32,
    # read by every token), the GroupedLinear kernels [E, in, out] split by expert.
    (r"(^|/)mlp/router/kernel$", ("embed", "router")),
    (r"(^|/)mlp/gate_up/kernel$", ("expert", "embed", "expert_mlp")),
    (r"(^|/)mlp/down/kernel$", ("expert", "expert_mlp", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    (r"(^|/)\w*norm/scale$", ("norm",)),
)

# Logical name -> mesh axes, for parameters (and moments, gradients) ...
PARAM_RULES: tuple[tuple[str, Any], ...] = (
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),  # norm scales are tiny: replicated
    ("router", None),
    ("expert", "expert"),
    # Expert FFN features stay whole: the grouped GEMMs run per device on whole experts
    # (tensor ranks compute the same expert rows; docs/moe.md).
    ("expert_mlp", None),
)

# ... and for activations (models.sharding.constrain reads these via nnx.logical_axis_rules).
ACTIVATION_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("sequence", None),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    # The experts' dimension of a mixture of experts (models.moe_dispatch).
    ("expert", "expert"),
    # The mesh axes whose ranks hold different rows of the batch, manual ones included
    # (activation_rules keeps them): a model sums batch statistics over those that are
    # manual where it runs (models.moe's routing losses). Names no array's dimension.
    ("global_batch", BATCH_AXES),
)


def path_string(key_path) -> str:
    """'layers/0/attn/q_proj/kernel' for a jax key path (nnx's trailing '/value' dropped)."""
    text = jax.tree_util.keystr(key_path, simple=True, separator="/")
    return text.removesuffix("/value")


def logical_axes(path: str, ndim: int) -> tuple[str, ...] | None:
    """The logical names of a parameter (or moment) at ``path``; None if no rule names it."""
    for pattern, names in PARAM_AXES:
        if re.search(pattern, path) and len(names) == ndim:
            return names
    return None


def _size(mesh_shape, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh_shape[n] for n in names)


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def with_data_axis(spec: P, shape: tuple[int, ...], mesh_shape: dict[str, int]) -> P:
    """``spec`` with ``data`` added (ZeRO-1): after the axes of the dimension already
    sharded over ``fsdp``, else of the largest dimension the combined axes divide; the spec
    itself if no dimension can take it (a small vector stays whole on data)."""
    data = mesh_shape.get("data", 1)
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    if data == 1 or not shape:
        return spec
    fsdp_dims = [d for d, e in enumerate(entries) if "fsdp" in _names(e)]
    order = fsdp_dims + sorted((d for d in range(len(shape)) if d not in fsdp_dims),
                               key=lambda d: -shape[d])
    for dim in order:
        names = _names(entries[dim])
        if shape[dim] % (_size(mesh_shape, names or None) * data) == 0:
            entries[dim] = names + ("data",) if names else "data"
            return P(*entries)
    return spec


def param_spec(path: str, shape: tuple[int, ...], mesh_shape: dict[str, int],
               rules=PARAM_RULES) -> P:
    """The PartitionSpec of a parameter-shaped array (parameter, moment or gradient).

    Named by PARAM_AXES and mapped by ``rules``; an unnamed array of rank >= 2 is FSDP-sharded
    on its largest dimension that ``fsdp`` divides (ZeRO-3 for parameters of other models),
    an unnamed vector or scalar is replicated.
    """
    names = logical_axes(path, len(shape))
    if names is None:
        spec = [None] * len(shape)
        fsdp = mesh_shape.get("fsdp", 1)
        if len(shape) >= 2 and fsdp > 1:
            for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
                if shape[axis] % fsdp == 0:
                    spec[axis] = "fsdp"
                    break
        return P(*spec)
    table = dict(rules)
    spec = []
    for dim, name in zip(shape, names):
        entry = table.get(name)
        spec.append(entry if entry is not None and dim % _size(mesh_shape, entry) == 0 else None)
    return P(*spec)


def state_shardings(tree: Any, mesh, shard_optimizer: bool = False) -> Any:
    """NamedShardings for the train state (or any tree of parameter-shaped leaves):
    parameters and their Adam moments by the rules, counters and keys replicated.
    ``shard_optimizer``: floating-point leaves (masters, moments) also split over ``data``
    (ZeRO-1, ``with_data_axis``)."""
    mesh_shape = dict(mesh.shape)

    def one(key_path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            return NamedSharding(mesh, P())
        spec = param_spec(path_string(key_path), shape, mesh_shape)
        if shard_optimizer and jnp.issubdtype(leaf.dtype, jnp.floating):
            spec = with_data_axis(spec, shape, mesh_shape)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def activation_rules(manual_axes=()) -> tuple[tuple[str, Any], ...]:
    """ACTIVATION_RULES for code running inside a ``shard_map`` whose ``manual_axes`` are
    manual: those axes are already split off by the shard_map, so no constraint names them.
    There the embedding lookup is also vocabulary-parallel over ``tensor`` ("lookup_vocab",
    ``models.embedding_lookup``: XLA's SPMD partitioner aborts on the plain gather there;
    outside, the partitioner's all-to-all plan compiles and is cheaper, so no rule)."""
    if not manual_axes:
        return ACTIVATION_RULES
    rules = tuple((name, entry if name == "global_batch" else _entry_without(entry, manual_axes))
                  for name, entry in ACTIVATION_RULES)
    return rules + (("lookup_vocab", "tensor"),)


def data_shard_map_axes(mesh) -> tuple[str, ...]:
    """The axes the trainer's data shard_map is manual over: ``data`` and every other axis
    of size 1. A size-1 axis splits nothing, and left to the partitioner it makes the body
    partly manual, where JAX's custom partitioners (cuDNN attention, the block-scaled
    GEMMs) fail to compile; with fsdp and tensor of size 1 the body is fully manual."""
    return ("data",) + tuple(a for a in mesh.axis_names if a != "data" and mesh.shape[a] == 1)


def _entry_without(entry, axes):
    """A rule or spec entry (None, a name, a tuple of names) with mesh ``axes`` left out."""
    kept = tuple(n for n in _names(entry) if n not in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def spec_without(spec: P, axes) -> P:
    """``spec`` with mesh ``axes`` left out (for constraints inside a shard_map manual over them)."""
    return P(*(_entry_without(e, axes) for e in spec))


def batch_sharding(mesh) -> NamedSharding:
    """[accum, micro-batch, L] batches: micro-batch rows over (data, fsdp, expert); every
    tensor rank of a data/fsdp/expert coordinate sees the same rows."""
    return NamedSharding(mesh, P(None, BATCH_AXES))


def sharding_report(tree: Any, mesh_shape: dict[str, int]) -> list[tuple[str, tuple, P, bool]]:
    """(path, shape, spec, fell_back) per parameter-shaped leaf: fell_back is True where a
    rule named a mesh axis that does not divide the dimension (left unsharded there)."""
    rows = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            continue
        path = path_string(key_path)
        spec = param_spec(path, shape, mesh_shape)
        names = logical_axes(path, len(shape))
        table = dict(PARAM_RULES)
        wanted = tuple(table.get(n) for n in names) if names else tuple(spec)
        fell_back = any(w is not None and _size(mesh_shape, w) > 1 and s is None
                        for w, s in zip(wanted, tuple(spec) + (None,) * len(shape)))
        rows.append((path, shape, spec, fell_back))
    return rows
