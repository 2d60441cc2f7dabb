"""ZeRO-1's weight all-gather where the recipe has ``param_gather``: FP8/FP4 bytes, quantized
from the FP32 masters.

Under ZeRO-1 (``mesh.shard_optimizer``) each data rank holds a slice of every FP32 master and
the step gathers the weights once, before its data shard_map, the matrices in the compute
dtype (``step.gathered_weights``). A quantized Linear with ``param_gather`` (Megatron's
fp8/fp4_param_gather) must quantize its weight from the FP32 master, which a BF16 gather
has rounded, so its kernel is instead

- ``sliced``: handed to the shard_map as the rank's FP32 slice; the weight cache quantizes
  each slice as the whole kernel (the tensor amax maxed over data) and all-gathers the bytes
  and scales over data, once per step (``weight_cache.make``, as Megatron gathers FP8/FP4
  parameters). For the scanned layers' prepared Linears when every axis but data has size 1
  (the data shard_map fully manual) and the slices hold whole blocks; or else
- ``full``: gathered in FP32, so that the copies made inside come from the master.

Only where the copies are made and what the gather moves change: the values are those of
quantizing the whole FP32 master (tests/training/test_zero1_gather.py).
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.gemm.param_gather import keeps_whole_blocks
from lp_jax.parallel.partitioning import path_string
from lp_jax.training.layer_stacks import LayerStacks
from lp_jax.training.weight_cache import kernel_path, prepared_linears

DATA = "data"


@dataclasses.dataclass(frozen=True)
class Zero1Gather:
    """Which kernels ZeRO-1 gathers as quantized bytes (``sliced``: path -> the dimension
    sliced over data) and which in FP32 (``full``, paths)."""

    sliced: dict = dataclasses.field(default_factory=dict)
    full: frozenset = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.sliced or self.full)


def param_gather_kernels(graphdef, params, rest) -> set[str]:
    """Paths of the kernels of every quantized Linear whose recipe has param_gather (those
    whose GEMM gathers bytes over fsdp itself too: ZeRO-1 gathers their data slices first)."""
    model = nnx.merge(graphdef, params, rest)
    found = set()
    for path, node in nnx.iter_graph(model):
        dg = getattr(node, "dot_general", None) if isinstance(node, nnx.Linear) else None
        if isinstance(dg, LowPrecisionDotGeneral) and dg.recipe.quantized and dg.recipe.param_gather:
            found.add("/".join(map(str, tuple(path) + ("kernel",))))
    return found


def _sliced_dim(sharding) -> int | None:
    """The one dimension a ZeRO-1 sharding splits over data, or None."""
    dims = [d for d, entry in enumerate(sharding.spec)
            if entry == DATA or (isinstance(entry, tuple) and DATA in entry)]
    return dims[0] if len(dims) == 1 else None


def plan(spec, graphdef, params, rest) -> Zero1Gather:
    """The ZeRO-1 gather of the param_gather kernels of a step with ``spec`` (a StepSpec)."""
    if not spec.shard_optimizer or spec.data_ranks == 1:
        return Zero1Gather()
    kernels = param_gather_kernels(graphdef, params, rest)
    if not kernels:
        return Zero1Gather()
    mesh_shape = dict(spec.mesh.shape)
    fully_manual = all(n == 1 for a, n in mesh_shape.items() if a != DATA)
    shardings = {path_string(p): s for p, s in
                 jax.tree_util.tree_leaves_with_path(spec.state_shardings(params))}
    shapes = {path_string(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    sliced = {}
    if fully_manual and spec.cache_weights:
        stacks = LayerStacks(graphdef, params, rest)
        linears = prepared_linears(stacks)
        for start, end in stacks.runs:
            for keys, (recipe, _) in linears.get(start, {}).items():
                paths = [kernel_path(i, keys) for i in range(start, end)]
                dims = {_sliced_dim(shardings[p]) for p in paths}
                dim = dims.pop() if len(dims) == 1 else None
                if dim is None or not all(p in kernels for p in paths):
                    continue
                shape = shapes[paths[0]]
                local = tuple(n // (mesh_shape[DATA] if d == dim else 1) for d, n in enumerate(shape))
                if keeps_whole_blocks(recipe, local, shape):
                    sliced.update({p: dim for p in paths})
    return Zero1Gather(sliced, frozenset(kernels - sliced.keys()))
