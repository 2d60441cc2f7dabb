"""One MoE layer with its experts split over 4 forced CPU devices, its dispatch in the
activation dtype and in FP8 (mesh.ep_dispatch_dtype, lp_jax/parallel/expert_dispatch.py),
for tests/parallel/test_fp8_dispatch.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/fp8_dispatch_layer.py mxfp8 ...

Per recipe (every GEMM quantized, F0L0): the routed output of a tiny MoE layer (8 experts,
2 per token, 128 tokens, BF16 activations) under the trainer's activation rules on a mesh
with expert=4, with each dispatch, and its error against the layer with BF16 GEMMs; the
gradients of sum(out^2) by the kernels and the input; the operand bytes of the all-to-alls
(by element type) of the forward and of the gradient, lowered and compiled. Prints one JSON
line per recipe.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lp_jax
from lp_jax import context, model_registry
from lp_jax.parallel.expert_dispatch import fp8_dispatch, set_expert_dispatch
from lp_jax.parallel.mesh import BATCH_AXES, make_mesh
from lp_jax.parallel.partitioning import activation_rules, state_shardings
from tests.support.all_to_all_bytes import compiled_all_to_all_bytes, lowered_all_to_all_bytes


def compare(recipe: str) -> dict:
    cfg = model_registry.preset("moe", "tiny", num_layers=1, dtype=jnp.bfloat16)
    model = model_registry.build_model("moe", cfg, nnx.Rngs(0))
    r = lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0)
    lp_jax.apply_recipe(model, r)
    mesh = make_mesh(1, 1, 1, 4, devices=jax.devices()[:4])
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    x_ep = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))

    def programs(dtype):
        set_expert_dispatch(model, r, dtype)
        graphdef, params, rest = nnx.split(model.layers[0].mlp, nnx.Param, ...)

        def forward(params, x):
            with context.rng_scope(jax.random.key(3)):
                return nnx.merge(graphdef, params, rest)(x)[0]

        def loss(params, x):
            return jnp.sum(forward(params, x).astype(jnp.float32) ** 2)

        def sharded(fn):
            def run(params, x):
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                        nnx.logical_axis_rules(activation_rules()):
                    return fn(params, x)
            return jax.jit(run)

        specs = state_shardings({"layers": {0: {"mlp": params}}}, mesh)["layers"][0]["mlp"]
        # The rows' gradient too: in a model, the dispatch's cotangent flows to earlier layers.
        return sharded(forward), sharded(jax.grad(loss, argnums=(0, 1))), jax.device_put(params, specs)

    out, grads, lowered, compiled = {}, {}, {}, {}
    # The reference: the layer's GEMMs in BF16 (FP32 sums), its dispatch in BF16.
    lp_jax.apply_recipe(model, "bf16")
    fwd, _, params = programs("bf16")
    reference = np.asarray(fwd(params, x_ep), np.float32)
    lp_jax.apply_recipe(model, r)
    for dtype in ("bf16", "fp8"):
        fwd, grad, params = programs(dtype)
        out[dtype] = np.asarray(fwd(params, x_ep), np.float32)
        g, dx = grad(params, x_ep)
        grads[dtype] = {k: np.asarray(g[k]["kernel"][...]) for k in ("gate_up", "down", "router")}
        grads[dtype]["x"] = np.asarray(dx, np.float32)
        # As JAX hands the program to XLA (the dtypes it asks for), and as XLA:CPU compiled it
        # (which moves BF16 all-to-alls in FP32).
        lowered[dtype] = [f.lower(params, x_ep) for f in (fwd, grad)]
        compiled[dtype] = [compiled_all_to_all_bytes(lo.compile().as_text()) for lo in lowered[dtype]]
        lowered[dtype] = [lowered_all_to_all_bytes(lo) for lo in lowered[dtype]]
    diff = np.abs(out["fp8"] - out["bf16"])
    return {
        "recipe": recipe,
        "dispatch_format": fp8_dispatch(r).fmt,
        "output_equal": bool(np.array_equal(out["fp8"], out["bf16"])),
        "output_max_rel": float(np.max(diff) / np.max(np.abs(out["bf16"]))),
        "output_rms_rel": float(np.sqrt(np.mean(diff ** 2) / np.mean(out["bf16"] ** 2))),
        # Each dispatch's output against the BF16 GEMMs' (RMS of the difference over the
        # reference's RMS): the recipe's own error, and with the FP8 dispatch's rounding.
        "error_vs_bf16_gemms": {d: float(np.sqrt(np.mean((o - reference) ** 2) / np.mean(reference ** 2)))
                                for d, o in out.items()},
        "grads_finite": all(bool(np.all(np.isfinite(v))) for v in grads["fp8"].values()),
        "grad_max_rel": {k: float(np.max(np.abs(grads["fp8"][k] - grads["bf16"][k]))
                                  / np.max(np.abs(grads["bf16"][k]))) for k in grads["bf16"]},
        "lowered_forward": {d: t[0] for d, t in lowered.items()},
        "lowered_grad": {d: t[1] for d, t in lowered.items()},
        "compiled_forward": {d: t[0] for d, t in compiled.items()},
        "compiled_grad": {d: t[1] for d, t in compiled.items()},
        "hidden": cfg.hidden_size,
        # Rows in one device's dispatch buffers: 4 ranks x 32 tokens x min(k, E / 4).
        "dispatch_rows": 4 * (x.shape[0] * x.shape[1] // 4) * min(cfg.moe_router_topk, cfg.num_experts // 4),
        "row_bytes": fp8_dispatch(r).row_bytes(cfg.hidden_size),
    }


def main(recipes) -> None:
    assert jax.device_count() == 8, jax.devices()
    for recipe in recipes:
        print(json.dumps(compare(recipe)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
