"""TFLOP/s of each training GEMM (fprop, dgrad, wgrad) per recipe, at Llama 3 8B's shapes.

    python bench/bench_gemms.py [--tokens 8192] [--shapes 4096x6144,4096x4096,4096x28672,14336x4096]
                                [--backend auto|native|reference] [--repeats 10] [--tiny]

A Linear [K in, N out] over M tokens runs three GEMMs of 2 M K N FLOPs each (docs/numerics.md):
fprop y = x W^T, dgrad dx = dy W, wgrad dW = dy^T x. Per shape and GEMM this prints BF16's
TFLOP/s, then each recipe's with its quantizers included (BF16 tensors in, the GEMM's output
out: what a training step pays, the copies it stores included) and excluded (operands
quantized beforehand, packed as the backward keeps them: the GEMM alone), with the speed-up
over BF16. The GEMMs run on the recipe's backend as "auto" picks it on this platform (or the
one given; a recipe written ``name@backend``, e.g. ``mxfp8@xla_scaled_dot``, runs on that
one); rows are printed as they are measured, so a time limit still leaves a table.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax as lp  # noqa: E402
from bench.common import median_seconds, platform_line  # noqa: E402
from lp_jax.gemm import backends  # noqa: E402
from lp_jax.gemm.operands import operand, stored  # noqa: E402

# Each GEMM: (tensor, the recipe field that quantizes it, its contraction axis) for lhs and rhs.
GEMMS = {
    "fprop": (("x", "fprop_x", 1), ("w", "fprop_w", 0)),
    "dgrad": (("dy", "dgrad_dy", 1), ("w", "dgrad_w", 1)),
    "wgrad": (("x", "wgrad_x", 0), ("dy", "wgrad_dy", 0)),
}
LLAMA3_8B_SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096"  # qkv, o, gate+up, down


def _gemm_fn(recipe, gemm, backend, prepare):
    """fn(tensors or operands, key) -> the GEMM's output, with operands made by ``prepare``
    (lp_jax.gemm.operands.operand: quantized inside; None: already prepared)."""
    (a, field_a, axis_a), (b, field_b, axis_b) = GEMMS[gemm]
    out_dtype = jnp.float32 if gemm == "wgrad" else jnp.bfloat16  # dW feeds the FP32 master

    def fn(ops, key):
        oa, ob = ops[a], ops[b]
        if prepare is not None:
            oa = prepare(oa, getattr(recipe, field_a), axis_a, key=jax.random.fold_in(key, 1))
            ob = prepare(ob, getattr(recipe, field_b), axis_b, key=jax.random.fold_in(key, 2))
        return backends.gemm(backend, backends.cuda_native(recipe), oa, ob, ((axis_a,), (axis_b,)),
                             jnp.bfloat16, out_dtype)
    return fn


def _prepared(recipe, gemm, tensors, key):
    """The GEMM's operands quantized and packed as the backward keeps them (outside timing)."""
    (a, field_a, axis_a), (b, field_b, axis_b) = GEMMS[gemm]
    pack = jax.jit(lambda ta, tb, key: (
        stored(ta, getattr(recipe, field_a), axis_a, key=jax.random.fold_in(key, 1)),
        stored(tb, getattr(recipe, field_b), axis_b, key=jax.random.fold_in(key, 2))))
    oa, ob = jax.block_until_ready(pack(tensors[a], tensors[b], key))
    return {a: oa, b: ob}


def tflops(recipe, gemm, tensors, backend, included, repeats, key):
    m, k = tensors["x"].shape
    n = tensors["w"].shape[1]
    if included:
        fn, ops = _gemm_fn(recipe, gemm, backend, operand), tensors
    else:
        fn, ops = _gemm_fn(recipe, gemm, backend, None), _prepared(recipe, gemm, tensors, key)
    seconds = median_seconds(jax.jit(fn), ops, key, repeats=repeats)
    return 2 * m * k * n / seconds / 1e12


def _recipe(spec: str):
    """A recipe from ``name`` or ``name@backend`` (that backend forced)."""
    name, _, backend = spec.partition("@")
    return lp.get_recipe(name, backend=backend) if backend else lp.get_recipe(name)


def _label(recipe) -> str:
    return recipe.name if recipe.backend == "auto" else f"{recipe.name}@{recipe.backend}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", default=LLAMA3_8B_SHAPES, help="K x N of each Linear, comma-separated")
    ap.add_argument("--recipes", default="fp8_cs,mxfp8,nvfp4,fp8_block")
    ap.add_argument("--backend", default="auto", choices=("auto", "native", "reference"))
    ap.add_argument("--modes", default="incl,excl", help="quantization incl(uded), excl(uded)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new row after this")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:  # a smoke run of every row: no time budget
        args.budget_s = None
        args.tokens, args.shapes, args.repeats = 200, "40x24", 2
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    recipes = [_recipe(spec) for spec in args.recipes.split(",")]
    modes = args.modes.split(",")
    start, key = time.perf_counter(), jax.random.key(0)
    print(platform_line())
    print(f"\nGEMM TFLOP/s, M = {args.tokens} tokens, backend {args.backend} "
          f"(on {backends.current_platform()}: " + ", ".join(
              f"{_label(r)} {backends.backend_on(r, backends.current_platform())}" for r in recipes) + ")")
    columns = ["K x N", "GEMM", "bf16"] + [f"{_label(r)} {m}" for r in recipes for m in modes]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    speedups = {c: [] for c in columns[3:]}
    for k, n in shapes:
        rng = jax.random.split(jax.random.key(1), 3)
        tensors = {"x": jax.random.normal(rng[0], (args.tokens, k), jnp.bfloat16),
                   "w": (jax.random.normal(rng[1], (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16),
                   "dy": jax.random.normal(rng[2], (args.tokens, n), jnp.bfloat16)}
        for gemm in GEMMS:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                print(f"(time budget of {args.budget_s:.0f} s spent: remaining rows skipped)")
                return 0
            base = tflops(lp.get_recipe("bf16"), gemm, tensors, "reference", True, args.repeats, key)
            cells = [f"{k}x{n}", gemm, f"{base:.3g}"]
            for r in recipes:
                backend = r.backend if r.backend != "auto" else {
                    "auto": backends.resolved(r), "native": r.native_backend}.get(args.backend, args.backend)
                for mode in modes:
                    t = tflops(r, gemm, tensors, backend, mode == "incl", args.repeats, key)
                    speedups[f"{_label(r)} {mode}"].append(t / base)
                    cells.append(f"{t:.3g} ({t / base:.2f}x)")
            print("| " + " | ".join(cells) + " |", flush=True)
    print("\ngeometric-mean speed-up over BF16: " + ", ".join(
        f"{c} {math.exp(sum(map(math.log, v)) / len(v)):.2f}x" for c, v in speedups.items() if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
