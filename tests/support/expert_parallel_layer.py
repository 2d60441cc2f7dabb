"""One MoE layer with its experts split over 4 forced CPU devices against the same layer on
one device, for tests/parallel/test_expert_parallel.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/expert_parallel_layer.py

For jax.lax.ragged_dot ("none") and each recipe (every GEMM quantized): the routed output of
a tiny MoE layer (8 experts, 2 per token, 128 tokens) under the trainer's activation rules
on a mesh with expert=4, and the gradients of sum(out^2) + 100 (aux + z loss) with
stochastic rounding keyed as the trainer keys it. Prints one JSON line per recipe.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lp_jax
from lp_jax import context, model_registry
from lp_jax.parallel.mesh import BATCH_AXES, make_mesh
from lp_jax.parallel.partitioning import activation_rules, state_shardings

RECIPES = ("none", "bf16", "fp8_cs", "mxfp8", "nvfp4")


def compare(recipe: str) -> dict:
    cfg = model_registry.preset("moe", "tiny", num_layers=1, dtype=jnp.bfloat16, moe_z_loss_coeff=1e-2)
    model = model_registry.build_model("moe", cfg, nnx.Rngs(0))
    if recipe != "none":
        lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0))
    layer = model.layers[0]
    graphdef, params, rest = nnx.split(layer.mlp, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.hidden_size), jnp.float32)

    def forward(params, x):
        with context.rng_scope(jax.random.key(3)):
            return nnx.merge(graphdef, params, rest)(x)

    def loss(params, x):
        out, stats = forward(params, x)
        return jnp.sum(out.astype(jnp.float32) ** 2) + 100 * (stats["aux_loss"] + stats["z_loss"])

    mesh = make_mesh(1, 1, 1, 4, devices=jax.devices()[:4])

    def sharded(fn):
        def run(params, x):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(activation_rules()):
                return fn(params, x)
        return jax.jit(run)

    # The trainer's parameter shardings: the paths as they are in the model ("layers/0/mlp/...").
    specs = state_shardings({"layers": {0: {"mlp": params}}}, mesh)["layers"][0]["mlp"]
    params_ep = jax.device_put(params, specs)
    x_ep = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    (out, stats), (out_ep, stats_ep) = jax.jit(forward)(params, x), sharded(forward)(params_ep, x_ep)
    out, out_ep = np.asarray(out, np.float32), np.asarray(out_ep, np.float32)
    row = {"recipe": recipe,
           "gate_up_shard": list(params_ep["gate_up"]["kernel"][...].addressable_shards[0].data.shape),
           "output_max_rel": float(np.max(np.abs(out - out_ep)) / np.max(np.abs(out))),
           # The routing statistics are sums over the tokens, which the partitioner takes per
           # device and then across: FP32 summation order.
           "stats_max_rel": max(float(np.max(np.abs(np.asarray(stats[k]) - np.asarray(stats_ep[k]))
                                          / np.maximum(np.abs(np.asarray(stats[k])), 1e-30))) for k in stats),
           "all_to_alls": sharded(forward).lower(params_ep, x_ep).as_text().count("all_to_all")}
    if recipe != "none":
        grads = jax.jit(jax.grad(loss))(params, x)
        grads_ep = sharded(jax.grad(loss))(params_ep, x_ep)
        g = {k: np.asarray(grads[k]["kernel"][...]) for k in ("gate_up", "down", "router")}
        g_ep = {k: np.asarray(grads_ep[k]["kernel"][...]) for k in ("gate_up", "down", "router")}
        row["expert_grads_equal"] = all(np.array_equal(g[k], g_ep[k]) for k in ("gate_up", "down"))
        row["router_grad_max_rel"] = float(np.max(np.abs(g["router"] - g_ep["router"])) / np.max(np.abs(g["router"])))
    return row


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    for recipe in RECIPES:
        print(json.dumps(compare(recipe)), flush=True)


if __name__ == "__main__":
    main()
