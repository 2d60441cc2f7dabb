"""Per-step losses of one short training run on several meshes, for test_sharded_training.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/sharded_runs.py nvfp4

A 2-layer tiny Llama, 5 steps of 8 x 32 mock tokens, with the trainer's own pieces (the
partitioning rules, the jitted step with its in/out shardings, the LM-head FP32 GEMM),
every Linear in the recipe (F0L0), for each recipe on one device, on meshes (data, fsdp,
tensor) = (8,1,1), (2,4,1), (2,2,2), the first and last also with ZeRO-1 (masters and
moments split over data too: "zero1" meshes, their last entry 1; FP8/FP4 recipes on
QUANTIZED_MESHES only), and twice more on one device as yardsticks of how far
rounding alone moves this trajectory: with the initial master weights moved by one FP32
ulp ("ulp"), and with each batch's rows in reverse order ("reversed": the same
mathematical step, every sum over the batch taken in another order, and for NVFP4 other
stochastic-rounding draws for the gradients, whose noise is indexed by position). Also the
BF16 recipe with FP32 activations (model.dtype=float32), where no BF16 or FP8 rounding
decision can flip. The micro-batch is the whole batch everywhere (no accumulation), so
the runs differ only in how the work is split. Prints one JSON line per run.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lp_jax
from lp_jax.data import pipeline as data_lib
from lp_jax.parallel.mesh import make_mesh
from lp_jax.training import state as state_lib
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.step import StepSpec, train_step
from models import llama

BATCH, SEQ, STEPS = 8, 32, 5
MESHES = ((8, 1, 1), (2, 4, 1), (2, 2, 2))
ZERO1_MESHES = ((8, 1, 1, 1), (2, 2, 2, 1))  # (data, fsdp, tensor, shard_optimizer)
# The FP8/FP4 recipes on three of the five: eight data ranks (the most separately drawn
# stochastic-rounding bits, the widest global amax), all three axes, and ZeRO-1 on all
# three. BF16 (and FP32 activations) keeps all five; each mesh costs a compilation of the
# sharded step (35-55 s on 2 cores), and 2x4x1 / 8x1x1 ZeRO-1 add no code path the others
# do not take.
QUANTIZED_MESHES = ((8, 1, 1), (2, 2, 2), (2, 2, 2, 1))


def meshes(case: str) -> tuple:
    return MESHES + ZERO1_MESHES if case in ("bf16", "fp32") else QUANTIZED_MESHES


# configs/tiny.yaml's schedule: step 1 at lr 0 (Megatron's init_lr), then warming up.
OPTIMIZER = OptimizerSpec(peak_lr=3e-3, min_lr=3e-4, init_lr=0.0, warmup_steps=30, decay_steps=300,
                          decay="cosine", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.033,
                          clip_grad_norm=1.0)


def batches(vocab: int) -> list[dict]:
    source = data_lib.MockSequences(vocab, SEQ, seed=0)
    return [{k: np.stack([source[b * BATCH + i][k] for i in range(BATCH)])
             for k in data_lib.EXAMPLE_KEYS} for b in range(STEPS)]


def build(recipe: str, dtype: str, mesh_sizes, param_gather: bool = True, tp_reduce_dtype: str = "fp32",
          amax_scope: str = "global", byte_gathers: bool = True):
    """(model config, graphdef, step spec, fresh state, mesh) as the trainer builds them for
    ``recipe`` with every Linear quantized (F0L0), precision.param_gather, amax_scope and
    mesh.tp_reduce_dtype as given (fp32 here, the partitioner's reductions, unless asked).
    ``byte_gathers=False``: the same recipe with each weight gathered by the partitioner (its
    FP32 master) instead of as quantized bytes."""
    from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
    from lp_jax.parallel.linear_layout import LinearLayout

    cfg = llama.preset("tiny", num_layers=2, dtype=jnp.dtype(dtype))
    mesh = make_mesh(*mesh_sizes[:3])
    spec = StepSpec(OPTIMIZER, 1, mesh, shard_optimizer=len(mesh_sizes) > 3 and bool(mesh_sizes[3]),
                    gather_dtype=jnp.dtype(dtype).name)
    tx = make_optimizer(OPTIMIZER)
    build_model = lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(build_model)
    lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0,
                                                 param_gather=param_gather, amax_scope=amax_scope),
                        layout=LinearLayout(dict(mesh.shape), tp_reduce_dtype))
    if not byte_gathers:
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Linear) and isinstance(node.dot_general, LowPrecisionDotGeneral):
                node.dot_general = dataclasses.replace(node.dot_general, gather=None)
    graphdef, params, rest = state_lib.split_model(model)
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    state = state_lib.init_state(build_model, tx, 0, spec.state_shardings(target))
    return cfg, graphdef, spec, state, mesh


def first_moment(opt_state):
    """Adam's first moment (mu) in the trainer's optimizer state: clip_by_global_norm, then
    adamw's chain, whose first link is scale_by_adam."""
    return opt_state[1][0].mu


def one_ulp_up(params):
    """The master weights one FP32 ulp up on a random (fixed) half of their elements."""
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda p: jnp.where(rng.random(p.shape) < 0.5, jnp.nextafter(p, jnp.inf), p), params)


def run(recipe: str, dtype: str, mesh_sizes, perturb: str = "") -> dict:
    cfg, graphdef, spec, state, mesh = build(recipe, dtype, mesh_sizes)
    if perturb == "ulp":
        state["params"] = one_ulp_up(state["params"])
    q_proj = lambda s: s["layers"][0]["attn"]["q_proj"]["kernel"]  # noqa: E731
    shard = list(q_proj(state["params"]).addressable_shards[0].data.shape)
    moment = list(q_proj(first_moment(state["opt_state"])).addressable_shards[0].data.shape)
    losses = []
    for batch in batches(cfg.vocab_size):
        if perturb == "reversed":  # the same examples, rows in the opposite order
            batch = {k: v[::-1].copy() for k, v in batch.items()}
        state, metrics = train_step(graphdef, spec, state, state_lib.place_batch(batch, 1, mesh))
        losses.append(float(metrics["loss"]))
    return {"recipe": recipe, "dtype": dtype, "mesh": list(mesh_sizes), "perturbed": perturb,
            "losses": losses, "q_proj_shard": shard, "q_proj_moment_shard": moment}


def main(case: str) -> None:
    """case: a recipe (one device, one device one ulp off, the three meshes; BF16
    activations) or "fp32" (the BF16 recipe with FP32 activations, one device and meshes)."""
    assert jax.device_count() == 8, jax.devices()
    if case == "fp32":
        plan = [("bf16", "float32", m, "") for m in ((1, 1, 1),) + meshes(case)]
    else:
        plan = [(case, "bfloat16", (1, 1, 1), p) for p in ("", "ulp", "reversed")]
        plan += [(case, "bfloat16", m, "") for m in meshes(case)]
    for args in plan:
        print(json.dumps(run(*args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
