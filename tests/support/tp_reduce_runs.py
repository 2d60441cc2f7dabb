"""First-step loss, gradients and compiled collectives of the tiny Llama under tensor
parallelism, with mesh.tp_reduce_dtype bf16 or fp32, for test_tp_reduce.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/tp_reduce_runs.py bf16 fp8_cs

Per recipe: the one-device run and its one-ulp yardstick, then meshes (data, fsdp, tensor)
with the given reduction dtype. Each run prints one JSON line: the step-1 loss of the trainer's
step (with its data-parallel shard_map where data > 1), the step's FP32 gradients (read
from Adam's first moment), and every collective of that compiled step with its dtype and
the mesh axes it spans.
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np
from flax import nnx

from bench.hlo_collectives import collectives, mesh_axes
from lp_jax.training import state as state_lib
from lp_jax.training.step import jitted_train_step
from tests.support.sharded_runs import OPTIMIZER, batches, build, first_moment, one_ulp_up

# (mesh, mesh.tp_reduce_dtype); tensor 2 for MXFP8, whose 32-element blocks along the tiny
# model's 64 attention features would straddle 4 ranks (the trainer refuses that mesh).
RUNS = (((1, 1, 4), "bf16"), ((1, 1, 4), "fp32"), ((2, 2, 2), "bf16"))


def runs(recipe: str):
    """BF16 on all of RUNS. The FP8/FP4 recipes skip the BF16 reduction on the pure tensor
    mesh: 2x2x2 takes the same tensor-axis code inside the data-parallel shard_map, and each
    mesh costs a compilation of the sharded step (about 40 s on 2 cores); the FP32 run
    stays, as their gradients' yardstick."""
    chosen = RUNS if recipe == "bf16" else tuple(r for r in RUNS if r != ((1, 1, 4), "bf16"))
    if recipe != "mxfp8":
        return chosen
    return tuple(((d, f, 2 if t == 4 else t), dtype) for (d, f, t), dtype in chosen)


def run(recipe: str, mesh_sizes, tp_reduce_dtype: str) -> dict:
    """tp_reduce_dtype "ulp": one device, the yardstick of sharded_runs (master weights one
    FP32 ulp up on a random half): how far rounding alone moves loss and gradients."""
    # The recipes' default weight path (param_gather off: weights quantized from their BF16
    # cast), on which the "ulp" yardstick and the tolerances below were set; the sharded runs
    # of param_gather (weights quantized from the FP32 masters) are test_param_gather.py's.
    cfg, graphdef, spec, state, mesh = build(recipe, "bfloat16", mesh_sizes, param_gather=False,
                                             tp_reduce_dtype="fp32" if tp_reduce_dtype == "ulp" else tp_reduce_dtype)
    if tp_reduce_dtype == "ulp":
        state["params"] = one_ulp_up(state["params"])
    model = nnx.merge(graphdef, state["params"], state["rest"])
    marked = {"/".join(map(str, path)): node.dot_general.tensor_reduce for path, node in nnx.iter_graph(model)
              if isinstance(node, nnx.Linear) and node.dot_general.tensor_reduce}
    host = batches(cfg.vocab_size)[0]
    batch = state_lib.place_batch(host, 1, mesh)
    # One compilation per run: the step that runs is the one whose HLO is read.
    compiled = jitted_train_step(spec, state).lower(graphdef, spec, state, batch).compile()
    text = compiled.as_text()
    new_state, metrics = compiled(state, batch)
    # The gradient, read from Adam's first moment after the first step: mu = (1 - b1) g with
    # mu starting at zero, g the trainer's own (clipped to global norm 1, a factor common to
    # every run up to rounding), so no second program computes it apart from the step.
    mu = first_moment(new_state["opt_state"])
    grads = jax.tree.map(lambda m: np.asarray(m, np.float32) / np.float32(1 - OPTIMIZER.b1), mu)
    names = dict(zip(("data", "fsdp", "tensor"), mesh_sizes))
    colls = [dict(kind=c.kind, dtype=c.dtype, bytes=c.bytes, narrow_bytes=c.narrow_bytes, runs=c.runs,
                  reducer=c.reducer, axes=list(mesh_axes(c.groups, names))) for c in collectives(text)]
    rows = host["tokens"].shape[0] // (mesh_sizes[0] * mesh_sizes[1])
    return {"recipe": recipe, "mesh": list(mesh_sizes), "tp_reduce_dtype": tp_reduce_dtype,
            "marked": marked, "activation_bytes": rows * host["tokens"].shape[1] * cfg.hidden_size * 4,
            "step_loss": float(metrics["loss"]),
            "grads": {"/".join(map(str, k)): np.asarray(g, np.float32).tolist()
                      for k, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                      for k in [[getattr(p, "key", getattr(p, "idx", p)) for p in k]]},
            "collectives": colls}


def main(recipes) -> None:
    assert jax.device_count() == 8, jax.devices()
    for recipe in recipes:
        for mesh_sizes, dtype in (((1, 1, 1), "bf16"), ((1, 1, 1), "ulp")) + runs(recipe):
            print(json.dumps(run(recipe, mesh_sizes, dtype)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
