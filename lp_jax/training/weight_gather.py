"""Which Linears gather quantized bytes under FSDP (``precision.param_gather``).

After ``apply_recipe``, the trainer gives every quantized Linear's dot_general the mesh
layout of its kernel from the partitioning rules (``("fsdp", "tensor")`` for q/k/v/gate/up,
``("tensor", "fsdp")`` for o/down), so that the GEMM quantizes each device's FP32 master
shard and all-gathers the FP8/FP4 bytes and scales (lp_jax/gemm/param_gather.py).

Only static attributes change (the dot_general, part of the graphdef): the state tree and
so the checkpoints are the same with param_gather on or off. Layers kept in BF16 by the
layer policy, the LM head and the embedding keep the partitioner's gather (of the BF16
cast: docs/scaling.md), as does every Linear when the kernel is not split over ``fsdp``.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.training.partitioning import param_spec


def kernel_spec(path: str, kernel_shape, mesh_shape: dict[str, int]) -> tuple:
    """The mesh axes of a Linear's 2-D kernel [in, out] (one entry per dimension) by the rules."""
    return (tuple(param_spec(f"{path}/kernel", tuple(kernel_shape), mesh_shape)) + (None, None))[:2]


def kernel_layout(path: str, kernel_shape, mesh_shape: dict[str, int]) -> tuple | None:
    """The kernel's mesh layout when FSDP splits it (else None: nothing to gather)."""
    if mesh_shape.get("fsdp", 1) <= 1 or len(kernel_shape) != 2:
        return None
    layout = kernel_spec(path, kernel_shape, mesh_shape)
    return layout if "fsdp" in layout else None


def set_weight_gathers(model, mesh_shape: dict[str, int]) -> list[str]:
    """Sets (or clears) the gather layout of every Linear running a quantized recipe with
    param_gather, in place; returns the paths that gather quantized bytes."""
    gathered = []
    for path, node in nnx.iter_graph(model):
        dg = getattr(node, "dot_general", None)
        if not isinstance(node, nnx.Linear) or not isinstance(dg, LowPrecisionDotGeneral):
            continue
        name = "/".join(map(str, path))
        layout = None
        if dg.recipe.quantized and dg.recipe.param_gather:
            layout = kernel_layout(name, node.kernel.shape, mesh_shape)
        if layout is not None:
            gathered.append(name)
        if dg.gather != layout:
            node.dot_general = dataclasses.replace(dg, gather=layout)
    return gathered
