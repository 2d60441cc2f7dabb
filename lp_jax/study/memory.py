"""Table 3: memory per component of a run's train step, per precision, without running it.

``memory_table_row(config, xla)`` gives the bytes of the master weights, gradients and
optimizer moments (the trainer's abstract train state), of what the backward keeps for one
micro-batch on one device (JAX's saved residuals: activations, of which the Linears' saved
inputs, and compute copies of parameters; sub-byte types at their width) and, with ``xla``,
XLA's ``memory_analysis()`` of the compiled train step. The method: docs/study.md, "How each
number is measured", and the paragraph under the report's Table 3.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints

import lp_jax
from lp_jax.config.schema import TrainConfig
from lp_jax.model_registry import build_model
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import batch_sharding
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.state import abstract_state, split_model
from lp_jax.training.step import StepSpec, forward_nll, jitted_train_step
from lp_jax.training.validate import resolve


def dtype_bits(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        return int(np.prod(data.shape)) * data.dtype.itemsize * 8
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 8
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return dtype.itemsize * 8


def nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype_bits(dtype) // 8


def tree_bytes(tree) -> int:
    return sum(nbytes(x.shape, x.dtype) for x in jax.tree.leaves(tree))


def _micro_batch(batch: int, seq_len: int) -> dict:
    ints = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    return {"tokens": ints, "targets": ints, "segment_ids": ints, "positions": ints,
            "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_)}


def _residuals(graphdef, params, rest, batch: int, seq_len: int) -> list[tuple]:

    # The trainer's own micro-batch forward (same model call, recipe and loss), on one
    # device: activations are counted per device and micro-batch.
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])

    def loss(p, micro, key):
        return forward_nll(graphdef, p, rest, micro, key, mesh)[0]

    return saved_residuals(loss, params, _micro_batch(batch, seq_len), jax.random.key(0))


def _is_linear_input(source: str) -> bool:
    """Saved by lp_jax's dot_general / quantizers (not by the model or the loss)."""
    path = source.replace("\\", "/")
    return "/lp_jax/" in path and "/lp_jax/training/" not in path


def residual_breakdown(graphdef, params, rest, micro_batch: int, seq_len: int) -> dict:
    small = _residuals(graphdef, params, rest, micro_batch, seq_len)
    large = _residuals(graphdef, params, rest, 2 * micro_batch, seq_len)
    out = {"activations": 0, "linear_inputs": 0, "parameter_copies": 0, "aliased_arguments": 0}
    # The two traces run the same program, so residual i is the same value in both; if
    # they ever differ in length, every non-argument residual counts as an activation.
    aligned = len(small) == len(large)
    for i, (aval, source) in enumerate(small):
        size = nbytes(aval.shape, aval.dtype)
        if source.startswith("from the argument"):
            out["aliased_arguments"] += size
        elif aligned and tuple(large[i][0].shape) == tuple(aval.shape):
            out["parameter_copies"] += size
        else:
            out["activations"] += size
            if _is_linear_input(source):
                out["linear_inputs"] += size
    out["residuals_aligned"] = aligned
    return out


def xla_step_memory(plan, graphdef, state, mesh) -> dict:
    """memory_analysis() of the compiled train step, compiled exactly as the trainer does
    (its jit, in/out shardings and donation), from abstract inputs."""
    cfg = plan.config
    spec = StepSpec.from_plan(plan, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, spec.state_shardings(state))
    rows = batch_sharding(mesh)
    per_pass = cfg.data.global_batch_size // plan.accum_steps
    batch = {k: jax.ShapeDtypeStruct((plan.accum_steps, *v.shape), v.dtype, sharding=rows)
             for k, v in _micro_batch(per_pass, cfg.data.seq_len).items()}
    step = jitted_train_step(spec, abstract)
    compiled = step.lower(graphdef, spec, abstract, batch).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    return {"xla_temp": int(analysis.temp_size_in_bytes),
            "xla_arguments": int(analysis.argument_size_in_bytes),
            "xla_outputs": int(analysis.output_size_in_bytes),
            "xla_aliased": int(analysis.alias_size_in_bytes)}


def memory_table_row(config: TrainConfig, xla: bool = True) -> dict:
    """Bytes per component for one run config (nothing is allocated; `xla` compiles)."""

    plan = resolve(config)
    model = nnx.eval_shape(lambda: build_model(config.model.type, plan.model_config, nnx.Rngs(config.seed)))
    swap = lp_jax.apply_recipe(model, plan.phases[0].recipe)
    graphdef, params, rest = split_model(model)
    tx = make_optimizer(OptimizerSpec.from_config(config))
    state = abstract_state((graphdef, params, rest), tx, config.seed)
    master = tree_bytes(state["params"])
    row = {"master_weights": master,
           # jax.grad returns each gradient in its parameter's dtype: FP32 like the masters.
           "gradients": master,
           "optimizer_moments": tree_bytes(state["opt_state"]),
           "micro_batch": config.data.micro_batch_size, "seq_len": config.data.seq_len,
           # A BF16 recipe also routes Linears through lp_jax's dot_general: none is quantized.
           "quantized_linears": len(swap.quantized) if plan.phases[0].recipe.quantized else 0,
           # Linears inside transformer layers (the embedding and LM head never quantize).
           "linears": len(swap.quantized) + len(swap.bf16_by_policy)}
    row.update(residual_breakdown(graphdef, params, rest, config.data.micro_batch_size,
                                  config.data.seq_len))
    row["other_activations"] = row["activations"] - row["linear_inputs"]
    if xla:
        row.update(xla_step_memory(plan, graphdef, state,
                                   make_mesh(plan.data_parallel, plan.fsdp, plan.tensor, plan.expert)))
    return row
