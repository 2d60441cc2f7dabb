"""One row of the plan: a recipe's step compiled for the GPUs and measured from the
compiled module (memory from XLA's buffer assignment, kernels, bytes, FLOPs, collectives)
and estimated (``roofline``)."""
from __future__ import annotations

import math

from lp_jax.model_registry import flops_per_token
from lp_jax.plan.compile_step import CompiledStep
from lp_jax.plan.gpus import GPU
from lp_jax.plan.hlo_module import DTYPE_BYTES, Module, arrays
from lp_jax.plan.kernels import kernels
from lp_jax.plan.roofline import estimate
from lp_jax.training.validate import ValidatedRun

LARGEST_BUFFERS = 5


def row(plan: ValidatedRun, gpu: GPU, count: int, step: CompiledStep) -> dict:
    """The JSON row of one compiled recipe (docs/plan.md lists the keys)."""
    memory = step.compiled.memory_analysis()
    per_gpu = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
               + memory.temp_size_in_bytes)
    module = Module.parse(step.text)
    est = estimate(kernels(module, count), gpu, count)
    cfg = plan.config
    model_flops = flops_per_token(cfg.model.type, plan.model_config, cfg.data.seq_len) * step.tokens_per_step / count
    recipe = plan.phases[0].recipe
    out = {
        "recipe": cfg.precision.recipe, "policy": recipe.policy,
        "memory": {"per_gpu_bytes": int(per_gpu), "capacity_bytes": gpu.memory_bytes,
                   "fits": bool(per_gpu <= gpu.memory_bytes),
                   "arguments_bytes": int(memory.argument_size_in_bytes),
                   "temp_bytes": int(memory.temp_size_in_bytes),
                   "params_bytes": step.params_bytes, "optimizer_bytes": step.optimizer_bytes},
        "gemms": est.gemms, "gemm_operand_types": est.gemm_types, "kernels": est.launches, "hbm_bytes": est.hbm_bytes,
        "flops": est.flops, "collective_bytes": est.collective_bytes,
        "estimate": {"step_s": est.step_s, "gemm_s": est.gemm_s, "other_s": est.other_s,
                     "collective_s": est.collective_s, "exposed_collective_s": est.exposed_collective_s,
                     "tflops_per_gpu": model_flops / est.step_s / 1e12,
                     "tokens_per_s": step.tokens_per_step / est.step_s, "x_bf16": None},
        "compile_s": step.compile_s,
    }
    if not out["memory"]["fits"]:
        out["memory"]["largest_buffers"] = largest_buffers(module)
        out["memory"]["would_help"] = what_would_help(plan)
    return out


def largest_buffers(module: Module, n: int = LARGEST_BUFFERS) -> list[dict]:
    """The largest arrays the executed computations produce (loop-carried state included),
    by bytes: where the temporaries go."""
    found = []
    for name in module.runs():
        for instr in module.computations[name].instructions:
            if instr.opcode in ("parameter", "get-tuple-element", "bitcast", "tuple"):
                continue
            for dtype, dims in arrays(instr.shape):
                found.append((int(DTYPE_BYTES[dtype] * math.prod(dims)), instr.name,
                              f"{dtype}[{','.join(map(str, dims))}]"))
    return [{"instruction": name, "shape": shape, "bytes": size}
            for size, name, shape in sorted(found, reverse=True)[:n]]


def what_would_help(plan: ValidatedRun) -> list[str]:
    cfg, model = plan.config, plan.model_config
    helps = []
    if model.attention_impl == "xla" and cfg.data.seq_len >= 2048:
        helps.append("model.attention_impl=cudnn (XLA's attention keeps the [T, S] scores)")
    if model.remat == "none" and not model.num_experts:  # the MoE block has no dense MLP to rebuild
        helps.append("model.remat=mlp (rebuild the MLP block from its input: gate and up run again)")
    if model.remat in ("none", "megatron", "dots_saveable"):
        helps.append("model.remat=elementwise (recompute the norm outputs and the SwiGLU product)")
    if model.remat != "full":
        helps.append("model.remat=full (recompute each layer in the backward)")
    if cfg.data.micro_batch_size > 1:
        helps.append(f"data.micro_batch_size={cfg.data.micro_batch_size // 2}")
    if plan.fsdp == 1 and not cfg.mesh.shard_optimizer:
        helps.append("mesh.shard_optimizer=true or a larger mesh.fsdp")
    return helps


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's estimated speed against the BF16 row's (None without one)."""
    base = next((r for r in rows if r.get("recipe") == "bf16" and "estimate" in r), None)
    for r in rows:
        if base is not None and "estimate" in r:
            r["estimate"]["x_bf16"] = base["estimate"]["step_s"] / r["estimate"]["step_s"]
    return rows
