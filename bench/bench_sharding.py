"""Per-device collective bytes and sharded state bytes of the llama3_8b train step, per mesh.

    python bench/bench_sharding.py [--recipe bf16] [--seq-len 8192] [--micro-batch 1]
                                   [--global-batch 768] [--meshes 1,8,1 8,8,1 8,1,1,z ...]

A mesh ``d,f,t,z`` runs ZeRO-1 (mesh.shard_optimizer: masters and Adam moments split over
data); ``d,f,t,fp32`` leaves the tensor-parallel partial sums to the partitioner's FP32
all-reduces (mesh.tp_reduce_dtype=fp32) instead of the trainer's default BF16 reduction. A second table splits the bytes by the mesh axes each collective runs over and
estimates the step's communication time (lp_jax/plan/comm_time.py) next to its compute time.

Nothing is allocated: the step is traced from jax.ShapeDtypeStructs carrying the
partitioning rules' shardings, lowered and compiled for the CPU backend on 64 forced host
devices (this script sets XLA_FLAGS=--xla_force_host_platform_device_count=64 unless
XLA_FLAGS is already set; an 8-device mesh uses the first 8). Columns:

- params / Adam: FP32 master weights / first+second moments held by one device (the FP32
  gradients take as much as the params at their peak);
- all-gather ... collective-permute: operand bytes one device feeds into each kind of
  collective during one optimizer step (every micro-batch, the optimizer update too),
  read from the compiled per-device HLO; collectives inside the scanned layers and the
  micro-batch scan are multiplied by those loops' trip counts;
- temp: XLA's temporary-buffer estimate for one device (the CPU compiler's, indicative).

The model is llama3_8b with ``scan_layers=True`` (32 layers compile as one scanned body
instead of 32 copies; the collectives are the same, counted per trip). The defaults are
the 8B configs': sequence 8192, micro-batch 1 per data-parallel rank, global batch 768.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax  # noqa: E402
from bench.common import platform_line, print_table  # noqa: E402
from bench.hlo_collectives import KINDS, all_gathers, collective_bytes, collectives, mesh_axes  # noqa: E402
from lp_jax.parallel.linear_layout import LinearLayout  # noqa: E402
from lp_jax.parallel.mesh import make_mesh  # noqa: E402
from lp_jax.parallel.partitioning import batch_sharding  # noqa: E402
from lp_jax.plan import comm_time  # noqa: E402
from lp_jax.plan.compile_step import device_bytes  # noqa: E402
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer  # noqa: E402
from lp_jax.training.state import abstract_state, split_model  # noqa: E402
from lp_jax.training.step import StepSpec, jitted_train_step  # noqa: E402
from models import llama  # noqa: E402

MESHES = ((8, 1, 1), (8, 1, 1, "z"), (1, 8, 1), (1, 4, 2, "fp32"), (1, 4, 2), (1, 1, 8, "fp32"), (1, 1, 8),
          (1, 64, 1), (8, 8, 1), (8, 8, 1, "z"), (1, 8, 8), (8, 1, 8))
OPTIMIZER = OptimizerSpec(peak_lr=6e-4, min_lr=6e-6, init_lr=0.0, warmup_steps=2000,
                          decay_steps=158946, decay="cosine", b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.033, clip_grad_norm=1.0)
GB = 1e9


def measure(sizes, recipe, seq_len, micro, global_batch, remat="none", zero1=False, tp_reduce_dtype="bf16"):
    data, fsdp, tensor = sizes
    mesh = make_mesh(data, fsdp, tensor)
    cfg = llama.preset("llama3_8b", scan_layers=True, remat=remat)
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    # precision.param_gather and mesh.tp_reduce_dtype, as the trainer sets them
    lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe), layout=LinearLayout(dict(mesh.shape), tp_reduce_dtype))
    graphdef, params, rest = split_model(model)
    tx = make_optimizer(OPTIMIZER)
    target = abstract_state((graphdef, params, rest), tx, 0)
    per_pass = micro * data * fsdp
    accum = global_batch // per_pass
    spec = StepSpec(OPTIMIZER, accum, mesh, shard_optimizer=zero1,
                    gather_dtype=jnp.dtype(cfg.dtype).name)
    shardings = spec.state_shardings(target)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         target, shardings)
    row = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((accum, per_pass, seq_len), dt, sharding=row)
             for k, dt in (("tokens", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32),
                           ("positions", jnp.int32), ("loss_mask", jnp.bool_))}
    step = jitted_train_step(spec, state)
    t0 = time.perf_counter()
    compiled = step.lower(graphdef, spec, state, batch).compile()
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    opt = device_bytes(target["opt_state"], shardings["opt_state"])
    flops = llama.flops_per_token(cfg, seq_len) * global_batch * seq_len / (data * fsdp * tensor)
    label = f"{data}x{fsdp}x{tensor}" + (" ZeRO-1" if zero1 else "") + (f" TP {tp_reduce_dtype}" if tensor > 1 else "")
    return {"mesh": label,
            "devices": data * fsdp * tensor, "accum": accum,
            "params": device_bytes(target["params"], shardings["params"]), "adam": opt,
            **collective_bytes(text), "temp": temp, "compile_s": seconds,
            "comm": communication(text, dict(mesh.shape), flops), "hlo": text, "vocab": cfg.vocab_size}


# ------------------------------------------------ precision.param_gather (docs/scaling.md)
# BF16 (the partitioner's gather), FP8-CS with param_gather off (the same BF16 gather), then
# each quantized recipe with it on. Policy F0L0: every layer quantized, so every layer-weight
# gather is a quantized one and the ratio to BF16 is per gathered weight.
GATHER_RUNS = (("bf16", True), ("fp8_cs", False), ("fp8_cs", True), ("mxfp8", True), ("nvfp4", True))
_CODES = {"fp8_e4m3": "E4M3", "mxfp8": "E4M3 + E8M0 scales", "nvfp4": "E2M1 (2 per byte) + E4M3 scales"}


def weight_gather_row(sizes, name, param_gather, seq_len, micro, global_batch):
    """One row: the layer weights' all-gather bytes per device per step (forward and
    backward, at the type the data has before XLA:CPU widens it), their types, the LM head's
    and the compiled step's totals."""
    recipe = lp_jax.get_recipe(name, policy="F0L0", param_gather=param_gather)
    r = measure(sizes, recipe, seq_len, micro, global_batch)
    gathers = [g for g in all_gathers(r["hlo"]) if not g["wire"].startswith(("s", "u32", "pred"))]
    head = [g for g in gathers if str(r["vocab"]) in g["shape"]]
    layers = [g for g in gathers if g not in head]
    quantized = recipe.quantized and param_gather
    moved = f"u8: {_CODES[recipe.fprop_w.fmt]}" if quantized else "/".join(sorted({g["wire"] for g in layers}))
    label = f"{name}, param_gather {'on' if param_gather else 'off'}" if recipe.quantized else name
    return {"mesh": r["mesh"], "recipe": label,
            "moved": moved, "layers": sum(g["bytes"] for g in layers), "head": sum(g["bytes"] for g in head),
            "all_gather": r["all-gather"], "total": sum(r[k] for k in KINDS), "compile_s": r["compile_s"]}


def print_weight_gathers(meshes, seq_len, micro, global_batch) -> None:
    rows = []
    for sizes in meshes:
        bf16 = None
        for name, param_gather in GATHER_RUNS:
            g = weight_gather_row(sizes, name, param_gather, seq_len, micro, global_batch)
            bf16 = bf16 or g["layers"]
            rows.append([g["mesh"], g["recipe"], g["moved"], f"{g['layers'] / GB:.2f}",
                         f"{g['layers'] / bf16:.3f}", f"{g['head'] / GB:.2f}", f"{g['all_gather'] / GB:.2f}",
                         f"{g['total'] / GB:.2f}", f"{g['compile_s']:.0f}"])
            print(f"  compiled {g['mesh']} {g['recipe']} in {g['compile_s']:.0f} s", flush=True)
    print_table(["mesh d x f x t", "recipe (F0L0)", "layer weights gathered as", "layer-weight all-gather GB",
                 "x BF16", "LM head all-gather GB", "all-gather GB (compiled)", "all collectives GB (compiled)",
                 "compile s"], rows,
                title=f"llama3_8b FSDP weight all-gathers, sequence {seq_len}, micro-batch {micro} per rank, "
                      f"global batch {global_batch}: bytes per device per optimizer step, forward and backward")


def communication(text: str, sizes: dict[str, int], flops_per_device: float) -> dict:
    """Bytes per device per step by the mesh axes they cross (data sums = the gradient
    reduction; data gathers = ZeRO-1's weights, at the width the values were rounded to,
    as a GPU sends them), and the step's communication seconds with 8 GPUs per node (all
    NVLink on 8 devices; across nodes at 50 GB/s on 64) and with 1 GPU per node (every
    collective over the network), beside compute seconds at the BF16 peak."""
    found = collectives(text)
    narrow = [dataclasses.replace(c, bytes=c.narrow_bytes) for c in found]
    out = {"data_sum": 0, "data_gather": 0, "fsdp": 0, "tensor": 0}
    for c in narrow:
        axes = mesh_axes(c.groups, sizes)
        if axes == ("data",) and c.kind in ("all-reduce", "reduce-scatter"):
            out["data_sum"] += c.bytes * c.runs
        elif axes == ("data",) and c.kind == "all-gather":
            out["data_gather"] += c.bytes * c.runs
        elif axes == ("fsdp",):
            out["fsdp"] += c.bytes * c.runs
        elif axes == ("tensor",):
            out["tensor"] += c.bytes * c.runs
    devices = int(np.prod(list(sizes.values())))
    out["node_s"] = comm_time.seconds(narrow, devices, gpus_per_node=8)
    out["network_s"] = comm_time.seconds(narrow, devices, gpus_per_node=1)
    out["compute_s"] = comm_time.compute_seconds(flops_per_device)
    return out


def communication_table(rows: list[dict], title: str) -> None:
    print_table(["mesh d x f x t", "data-axis sums GB", "data-axis gathers GB", "fsdp GB", "tensor GB",
                 "comm s, 8 GPUs/node", "comm s, 1 GPU/node (50 GB/s)", "compute s (BF16 peak)"],
                [[r["mesh"], *(f"{r['comm'][k] / GB:.2f}" for k in ("data_sum", "data_gather", "fsdp", "tensor")),
                  *(f"{r['comm'][k]:.2f}" for k in ("node_s", "network_s", "compute_s"))] for r in rows],
                title=title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="bf16")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=768)
    parser.add_argument("--remat", default="none", choices=llama.REMAT_POLICIES)
    parser.add_argument("--meshes", nargs="*", default=[",".join(map(str, m)) for m in MESHES],
                        help="data,fsdp,tensor triples, ',z' for ZeRO-1, ',fp32' for FP32 tensor-parallel reductions")
    parser.add_argument("--param-gather", action="store_true",
                        help="the weight all-gather table (precision.param_gather) for the meshes "
                             "(default 1,8,1 1,64,1) instead of the per-mesh table")
    args = parser.parse_args()
    print(platform_line())
    if args.param_gather:
        meshes = [(1, 8, 1), (1, 64, 1)] if args.meshes == parser.get_default("meshes") else \
            [tuple(int(v) for v in m.split(",")) for m in args.meshes]
        print_weight_gathers(meshes, args.seq_len, args.micro_batch, args.global_batch)
        return
    rows = []
    results = []
    for text in args.meshes:
        fields = text.split(",")
        sizes, zero1 = tuple(int(v) for v in fields[:3]), "z" in fields[3:]
        tp_reduce_dtype = "fp32" if "fp32" in fields[3:] else "bf16"
        if np.prod(sizes) > jax.device_count():
            print(f"skipping mesh {text}: needs {np.prod(sizes)} devices")
            continue
        r = measure(sizes, args.recipe, args.seq_len, args.micro_batch, args.global_batch, args.remat, zero1,
                    tp_reduce_dtype)
        results.append(r)
        rows.append([r["mesh"], r["devices"], r["accum"], f"{r['params'] / GB:.2f}", f"{r['adam'] / GB:.2f}",
                     *(f"{r[k] / GB:.2f}" for k in KINDS),
                     "n/a" if r["temp"] is None else f"{r['temp'] / GB:.1f}", f"{r['compile_s']:.0f}"])
        print(f"  compiled {r['mesh']} in {r['compile_s']:.0f} s", flush=True)
    print_table(["mesh d x f x t", "devices", "micro-batches", "params GB", "Adam GB",
                 *(f"{k} GB" for k in KINDS), "temp GB", "compile s"], rows,
                title=f"llama3_8b, {args.recipe}, remat {args.remat}, sequence {args.seq_len}, micro-batch "
                      f"{args.micro_batch} per data-parallel rank, global batch {args.global_batch}: "
                      "bytes per device per optimizer step")
    communication_table(results, "by mesh axis (BF16 collectives at BF16 width), and time per step: "
                                 "NVLink 450 GB/s, network 50 GB/s per GPU, bandwidth only, no overlap")


if __name__ == "__main__":
    main()
