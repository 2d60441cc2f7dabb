"""The trainer's train step, built from abstract state and batch and compiled for GPUs that
are only described (JAX's CUDA plugin, no device needed): the program those GPUs would run.

The model, the recipe with its layout, the step's spec, the state's shardings and the batch
are built as ``lp_jax.training.loop.build`` builds them, but as ShapeDtypeStructs on a mesh
of the topology's devices, so nothing is allocated and no data is read.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies

import lp_jax
from lp_jax.errors import UserError
from lp_jax.kernels.cuda_target import cuda_target
from lp_jax.kernels.launch import compiled_kernels
from lp_jax.model_registry import build_model
from lp_jax.parallel.expert_dispatch import set_expert_dispatch
from lp_jax.parallel.linear_layout import LinearLayout
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import batch_sharding
from lp_jax.plan.cudnn_target import cudnn_sees
from lp_jax.plan.gpus import GPU
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.state import abstract_state, split_model
from lp_jax.training.step import StepSpec, jitted_train_step
from lp_jax.training.validate import ValidatedRun

BATCH_KEYS = (("tokens", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32),
              ("positions", jnp.int32), ("loss_mask", jnp.bool_))


def topology_devices(gpu: GPU, count: int) -> list:
    """``count`` abstract GPUs of kind ``gpu`` (deviceless)."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=gpu.target_config(), topology=f"1x1x{count}")
    return list(topology.devices)


@dataclasses.dataclass
class CompiledStep:
    compiled: jax.stages.Compiled
    text: str  # the optimized module
    params_bytes: int  # FP32 masters and other model state, per device
    optimizer_bytes: int  # Adam moments and counters, per device
    compile_s: float
    tokens_per_step: int


def device_bytes(tree, shardings) -> int:
    """Bytes of ``tree``'s leaves held by one device under ``shardings``."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += jnp.dtype(leaf.dtype).itemsize * math.prod(shard)
    return total


# XLA's words when it must build a cuDNN graph and has no GPU driver to build it with.
_NEEDS_DRIVER = "deviceless cuDNN compilation is not enabled"
# The first JAX whose XLA does that for Blackwell (pyproject.toml's gpu extra stays below it).
DEVICELESS_CUDNN_JAX_LIMIT = "0.12.1"


def compile_lowered(lowered):
    """``lowered`` compiled, with a deviceless compile's one known dead end explained."""
    try:
        return lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if _NEEDS_DRIVER not in str(e):
            raise
        raise UserError(
            f"JAX {jax.__version__}'s XLA builds cuDNN's graphs (attention, block-scaled GEMMs) "
            "while it compiles for this GPU, and that needs a CUDA driver; compiling without a GPU "
            f"needs JAX below {DEVICELESS_CUDNN_JAX_LIMIT}: pip install -e '.[gpu]' installs one"
        ) from None


def compile_step(plan: ValidatedRun, gpu: GPU, count: int) -> CompiledStep:
    """The plan's first phase's train step compiled for ``count`` GPUs of kind ``gpu``."""
    cfg = plan.config
    mesh = make_mesh(plan.data_parallel, plan.fsdp, plan.tensor, plan.expert, devices=topology_devices(gpu, count))
    spec = StepSpec.from_plan(plan, mesh)
    tx = make_optimizer(spec.optimizer)
    model = nnx.eval_shape(lambda: build_model(cfg.model.type, plan.model_config, nnx.Rngs(cfg.seed)))
    lp_jax.apply_recipe(model, plan.phases[0].recipe,
                        layout=LinearLayout(dict(mesh.shape), cfg.mesh.tp_reduce_dtype))
    set_expert_dispatch(model, plan.phases[0].recipe, cfg.mesh.ep_dispatch_dtype)
    graphdef, params, rest = split_model(model)
    target = abstract_state((graphdef, params, rest), tx, cfg.seed)
    shardings = spec.state_shardings(target)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, shardings)
    per_pass = cfg.data.micro_batch_size * plan.data_parallel * plan.fsdp * plan.expert
    rows = batch_sharding(mesh)
    # The data's keys: no segment_ids without the per-document mask (lp_jax.data.pipeline).
    keys = [(k, dtype) for k, dtype in BATCH_KEYS
            if k != "segment_ids" or cfg.data.reset_attention_mask]
    batch = {k: jax.ShapeDtypeStruct((plan.accum_steps, per_pass, cfg.data.seq_len), dtype, sharding=rows)
             for k, dtype in keys}
    start = time.perf_counter()
    # Traced for CUDA: Pallas kernels compiled by Mosaic GPU, not interpreted as on this CPU.
    with compiled_kernels(), cudnn_sees(gpu), cuda_target(gpu.compute_capability):
        lowered = jitted_train_step(spec, state).trace(graphdef, spec, state, batch).lower()
    compiled = compile_lowered(lowered)
    return CompiledStep(compiled, compiled.as_text(),
                        device_bytes(target["params"], shardings["params"])
                        + device_bytes(target["rest"], shardings["rest"]),
                        device_bytes(target["opt_state"], shardings["opt_state"]),
                        time.perf_counter() - start, cfg.data.global_batch_size * cfg.data.seq_len)
