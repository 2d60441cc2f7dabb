"""The scanned layers' weight copies, made once per step before the micro-batch loop.

Each quantized Linear's dot_general derives its weight's GEMM copies (the cast to the
compute dtype and, for a quantized recipe, the amax, the scale, the FP8/FP4 bytes and
their transposed copy) from the FP32 master on every call, so under gradient
accumulation every micro-batch redoes them for every layer. Here the step makes each
scanned Linear's copies once, for the whole stack (one set per layer: per-tensor scales
stay per layer), and hands the model ``PreparedKernel``s (``lp_jax.gemm.prepared_kernel``)
in place of those kernels; the micro-batch loop then reads the copies, and the weight
gradient still reaches the master. The copies are those the dot_general would make, so
the step is the same bit for bit (tests/training/test_weight_cache.py).

Only Linears whose dot_general is lp_jax's and gathers no weight bytes (FSDP's
``param_gather`` quantizes each shard itself) and that cast their input to a set dtype are
prepared; the rest are left as they are. Under ZeRO-1 a kernel the step hands over as its
data rank's slice of the FP32 master (``lp_jax.training.zero1_gather``) has its copies
quantized from the slices and all-gathered over data as bytes here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.gemm.param_gather import gathered_copies
from lp_jax.gemm.prepared_kernel import PreparedKernel, prepare
from lp_jax.training.layer_stacks import LAYERS, LayerStacks

_VALUE = "value"  # the key a Variable's array has in a State's tree paths


def _keys(path) -> tuple:
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)
    return keys[:-1] if keys and keys[-1] == _VALUE else keys


def prepared_linears(stacks: LayerStacks) -> dict:
    """{run start: {kernel path inside the layer: (recipe, compute dtype)}} of the Linears
    whose kernels are prepared, read off each run's first layer (a run's layers share
    their graph, so their dot_generals)."""
    starts = {start for start, _ in stacks.runs}
    found = {start: {} for start in starts}
    for path, node in nnx.iter_graph(stacks.model):
        if not (isinstance(node, nnx.Linear) and len(path) > 2 and path[0] == LAYERS and path[1] in starts):
            continue
        dg = node.dot_general
        if isinstance(dg, LowPrecisionDotGeneral) and dg.gather is None and node.dtype is not None:
            found[path[1]][tuple(path[2:]) + ("kernel",)] = (dg.recipe, jnp.dtype(node.dtype))
    return found


def kernel_path(layer: int, keys: tuple) -> str:
    """The '/'-joined parameter path of a kernel at ``keys`` inside transformer layer ``layer``."""
    return "/".join(map(str, (LAYERS, layer) + tuple(keys)))


def make(stacks: LayerStacks, layer_stacks: dict, slices: dict | None = None, axis: str = "data") -> dict:
    """{run start: {kernel path: (fw, dgrad_w) stacked over the run's layers}}: the copies of
    every prepared kernel in ``layer_stacks`` (the runs' stacked Params), made now.
    ``slices``: {kernel path (``kernel_path``): (this device's slice of the FP32 master, the
    dimension sliced over mesh ``axis``)} for kernels whose copies are quantized from the
    slices and all-gathered as bytes (inside a shard_map manual over ``axis``)."""
    linears = prepared_linears(stacks)
    slices = slices or {}
    copies = {}
    for start, stack in layer_stacks.items():
        wanted = linears.get(start, {})
        layers = [i for s, end in stacks.runs if s == start for i in range(s, end)]
        copies[start] = {}
        for path, w in jax.tree_util.tree_flatten_with_path(stack)[0]:
            if (keys := _keys(path)) not in wanted:
                continue
            recipe, dtype = wanted[keys]
            sliced = [slices.get(kernel_path(i, keys)) for i in layers]
            if any(sliced):
                if not all(sliced):  # the others' masters are not there to quantize
                    raise ValueError(f"layers {layers} of {'/'.join(map(str, keys))}: some sliced, not all")
                dim = sliced[0][1]
                shards = jax.numpy.stack([shard for shard, _ in sliced])
                one = lambda s, recipe=recipe, dtype=dtype, dim=dim: jax.lax.stop_gradient(  # noqa: E731
                    gathered_copies(recipe, s, dtype, dim, axis))
                copies[start][keys] = (recipe, dtype, jax.vmap(one)(shards))
                continue
            # One layer at a time over the stack: per-tensor amaxes stay per layer.
            one = lambda w_l, recipe=recipe, dtype=dtype: _parts(prepare(recipe, w_l, dtype))  # noqa: E731
            copies[start][keys] = (recipe, dtype, jax.vmap(one)(w))
    return copies


def _parts(kernel: PreparedKernel):
    return kernel.fw, kernel.dgrad_w


def attach(layer_stacks: dict, copies: dict) -> dict:
    """``layer_stacks`` with each prepared kernel replaced by a PreparedKernel of its master
    (the array being differentiated) and its copies from ``make``."""
    out = {}
    for start, stack in layer_stacks.items():
        run = copies.get(start, {})

        def one(path, w, run=run):
            keys = _keys(path)
            if keys not in run:
                return w
            recipe, dtype, (fw, dgrad_w) = run[keys]
            return PreparedKernel(w, fw, dgrad_w, recipe, dtype.name)

        out[start] = jax.tree_util.tree_map_with_path(one, stack)
    return out
