"""The plan's estimate for Transformer Engine's published H200 GEMM benchmark, shape for shape.

Transformer Engine's GEMM profiling guide ("Worked Example: 5B Model on H200" in its docs)
times one layer's 12 GEMMs (fprop, dgrad, wgrad of QKV 4096->12288, attention out
4096->4096, MLP up 4096->16384, MLP down 16384->4096) at M = 31 x 512 = 15872 tokens on an
H200 NVL. This compiles the same four Linears through ``lp.dot_general`` (forward and the
VJP that gives dgrad and wgrad) for an H200 target, deviceless, and prints the roofline's
time beside TE's measurements. Needs JAX's CUDA plugin (pip install -e '.[gpu]').

    python bench/plan_te_gemms.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lp_jax.plan.environment import deviceless  # noqa: E402

deviceless()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import lp_jax as lp  # noqa: E402
from lp_jax.plan.compile_step import topology_devices  # noqa: E402
from lp_jax.plan.gpus import GPUS  # noqa: E402
from lp_jax.plan.hlo_module import Module  # noqa: E402
from lp_jax.plan.kernels import kernels  # noqa: E402
from lp_jax.plan.roofline import estimate  # noqa: E402

TOKENS = 31 * 512
LINEARS = ((4096, 12288), (4096, 4096), (4096, 16384), (16384, 4096))  # (K, N) of QKV, out, up, down
# TE's per-layer GEMM milliseconds on the H200 NVL (autocast includes quantization;
# pre-quantized is the GEMM kernels alone).
TE_MS = {"bf16": (32.014, 31.968), "fp8_cs": (20.285, 16.785)}


def layer(recipe):
    dg = lp.dot_general(recipe)

    def run(xs, ws, dys):
        outs = []
        for x, w, dy in zip(xs, ws, dys):
            y, vjp = jax.vjp(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))), x, w)
            outs.append((y, *vjp(dy)))
        return outs
    return run


def main() -> int:
    gpu = GPUS["h200"]
    mesh = jax.sharding.Mesh(topology_devices(gpu, 1), ("x",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    xs = [spec((TOKENS, k), jnp.bfloat16) for k, _ in LINEARS]
    ws = [spec((k, n), jnp.float32) for k, n in LINEARS]
    dys = [spec((TOKENS, n), jnp.bfloat16) for _, n in LINEARS]
    print("| recipe | est. GEMM ms | est. layer ms (GEMMs + quantization) | TE autocast ms | TE GEMMs only ms |")
    print("|---|---|---|---|---|")
    for name in ("bf16", "fp8_cs"):
        recipe = lp.get_recipe(name, first_bf16_layers=0, last_bf16_layers=0)
        text = jax.jit(layer(recipe)).trace(xs, ws, dys).lower().compile().as_text()
        est = estimate(kernels(Module.parse(text)), gpu, 1)
        autocast, gemms_only = TE_MS[name]
        print(f"| {name} | {est.gemm_s * 1e3:.2f} | {est.step_s * 1e3:.2f} | {autocast} | {gemms_only} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
