"""Per-step metrics of a short MoE training run on one device and on expert-parallel meshes,
for tests/parallel/test_expert_parallel.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/expert_parallel_runs.py bf16

A 2-layer tiny MoE (8 experts, 2 per token), 2 steps of 8 x 32 mock tokens with the
trainer's own pieces (the partitioning rules, the jitted step with its in/out shardings,
the data shard_map when mesh.data > 1), every GEMM in the recipe (F0L0), on one device and
on the (data, fsdp, tensor, expert) meshes of ``meshes``. Step 1 runs at learning rate 0, so
both steps see the initial weights (as in tests/support/sharded_runs.py). Prints one JSON
line per run: losses, gradient norms, the routing metrics, and the shard of one expert
kernel that device 0 holds.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lp_jax
from lp_jax import model_registry
from lp_jax.parallel.mesh import make_mesh
from lp_jax.training import state as state_lib
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.step import StepSpec, train_step
from tests.support.sharded_runs import OPTIMIZER, batches

STEPS = 2
# (data, fsdp, tensor, expert): expert parallelism alone, with data parallelism (the
# trainer's data shard_map around it), and with FSDP and tensor parallelism.
MESHES = {"bf16": ((1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 2, 2)),
          "mxfp8": ((1, 1, 1, 4), (2, 1, 1, 2))}


def meshes(recipe: str) -> tuple:
    return MESHES.get(recipe, MESHES["mxfp8"])


def run(recipe: str, sizes) -> dict:
    cfg = model_registry.preset("moe", "tiny", num_layers=2, dtype=jnp.bfloat16)
    data, fsdp, tensor, expert = sizes
    mesh = make_mesh(data, fsdp, tensor, expert, devices=jax.devices()[:data * fsdp * tensor * expert])
    spec = StepSpec(OPTIMIZER, 1, mesh, gather_dtype="bfloat16")
    tx = make_optimizer(OPTIMIZER)
    build = lambda: model_registry.build_model("moe", cfg, nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(build)
    lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0))
    graphdef, params, rest = state_lib.split_model(model)
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    state = state_lib.init_state(build, tx, 0, spec.state_shardings(target))
    kernel = state["params"]["layers"][0]["mlp"]["gate_up"]["kernel"]
    shard = list(kernel.addressable_shards[0].data.shape)  # before the step donates it
    rows = []
    for batch in batches(cfg.vocab_size)[:STEPS]:
        state, metrics = train_step(graphdef, spec, state, state_lib.place_batch(batch, 1, mesh))
        rows.append({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                     **{k: float(v) for k, v in metrics["extras"].items()}})
    return {"recipe": recipe, "mesh": list(sizes), "steps": rows,
            "gate_up_shard": shard}


def main(recipe: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    for sizes in ((1, 1, 1, 1),) + meshes(recipe):
        print(json.dumps(run(recipe, sizes)), flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main(sys.argv[1])
