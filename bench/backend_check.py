"""Every GEMM backend on this machine's devices: it compiles, runs, equals the reference,
keeps its quantization through compilation, and which GEMMs the optimized program calls.

    python bench/backend_check.py [--tiny]

Per recipe (fp8_cs, mxfp8, nvfp4 with stochastic rounding), a quantized Linear's forward
plus backward (y, dx, dW) with FP32 activations runs with the reference, the recipe's
native backend forced, and auto; the native and auto outputs must equal the reference run
on the same device to FP32 summation order (relative error <= 1e-6). Then the same
Linear with BF16 activations (what training runs) is compiled with auto and its optimized
HLO is read: the low-precision types must still be there (XLA on GPU may drop f32 -> fp8
-> f32 round trips as excess precision), FP8-CS must call ``__cublas$lt$matmul$f8``, and
MXFP8/NVFP4 show whether XLA ran cuDNN's block-scaled GEMM (Blackwell) or expanded the
block-scaled dot into dequantize-and-dot (Hopper). Exit status 1 if anything fails.
``--tiny`` runs small shapes (the test suite runs it on CPU, where only the equalities and
the types are checked).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax as lp  # noqa: E402
from bench.common import platform_line, print_table  # noqa: E402
from bench.hlo_gemms import BLOCK_SCALED_DOT, compiled_gemms  # noqa: E402
from lp_jax import context  # noqa: E402
from lp_jax.gemm import backends  # noqa: E402
from lp_jax.kernels.cuda_target import cuda_major  # noqa: E402

RECIPES = ("fp8_cs", "fp8_block", "mxfp8", "nvfp4")
# Element types the compiled program must still hold (E8M0 scales travel as uint8 codes).
TYPES = {"fp8_cs": ("f8e4m3fn", "f8e5m2"), "fp8_block": ("f8e4m3fn",), "mxfp8": ("f8e4m3fn",),
         "nvfp4": ("f4e2m1fn",)}
# x [..., K] x W [K, N]: K not a multiple of 32, M not a multiple of 128, N not of 16.
SHAPES = {"full": ((2, 1000, 1000), 776), "tiny": ((2, 25, 40), 24)}
TOLERANCE = 1e-6


def linear_vjp_fn(recipe):
    """(x [..., K], w [K, N], dy [..., N]) -> (y, dx, dW) of lp_jax's dot_general for ``recipe``
    (tests/gemm/test_backends.py uses it too)."""
    def f(x, w, dy):
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        with context.rng_scope(jax.random.key(5)):
            y, vjp = jax.vjp(lambda x, w: lp.dot_general(recipe)(x, w, dims), x, w)
        return (y, *vjp(dy))
    return f


def linear_vjp(recipe):
    return jax.jit(linear_vjp_fn(recipe))


def inputs(x_shape, n, dtype=jnp.float32, seed=0):
    """Gaussian x, dy (in ``dtype``) and a small FP32 kernel w."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(x_shape), dtype)
    w = jnp.asarray(rng.standard_normal((x_shape[-1], n)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal(x_shape[:-1] + (n,)), dtype)
    return x, w, dy


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def gemm_verdict(recipe: str, census: dict, platform: str) -> tuple[str, bool]:
    """What the optimized program runs the three GEMMs on, and whether that is acceptable."""
    if platform != "cuda":
        return f"{platform}: XLA's own dot (no GPU GEMM library)", True
    if recipe == "fp8_cs":
        n = census.get("__cublas$lt$matmul$f8", 0)
        return f"cuBLASLt FP8 GEMMs: {n}", n >= 3
    wgmma = census.get("lp_jax wgmma FP8 block GEMM", 0)
    if wgmma:
        return f"Pallas WGMMA FP8 block GEMM (Hopper): {wgmma}", wgmma >= 3
    cudnn = census.get("__cudnn$blockScaledDot", 0) + census.get("fusion __cudnn$fusion", 0)
    if cudnn >= 3:
        return f"cuDNN block-scaled GEMM: {cudnn}", True
    # Expected before Blackwell (no block-scaled MMA); on Blackwell it would be a slow path.
    capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
    blackwell = int(capability.split(".")[0]) >= 10
    return (f"expanded by XLA into dequantize + dot (compute capability {capability}; cuDNN calls "
            f"{cudnn}, {BLOCK_SCALED_DOT} left {census.get(BLOCK_SCALED_DOT, 0)})"), not blackwell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    args = ap.parse_args(argv)
    x_shape, n = SHAPES["tiny" if args.tiny else "full"]
    platform = backends.current_platform()
    print(platform_line())
    print(f"x {x_shape} x W [{x_shape[-1]}, {n}]; GEMM backends lowered for {platform}")
    f32 = inputs(x_shape, n, jnp.float32)
    bf16 = inputs(x_shape, n, jnp.bfloat16)
    rows, ok = [], True
    for name in RECIPES:
        recipe = lp.get_recipe(name)
        # Every native backend this device runs (Hopper's wgmma only on sm_90; on CPU in
        # Pallas's interpreter), then auto.
        natives = [b for b in recipe.native_backends if b != "wgmma" or cuda_major() in (None, 9)]
        outs = {}
        for backend in ("reference", *natives, "auto"):
            outs[backend] = linear_vjp(lp.get_recipe(name, backend=backend))(*f32)
        for backend in (*natives, "auto"):
            errs = [rel_err(a, b) for a, b in zip(outs[backend], outs["reference"])]
            good = max(errs) <= TOLERANCE
            ok &= good
            label = backend if backend != "auto" else f"auto ({backends.backend_on(recipe, platform)})"
            rows.append((name, label, *(f"{e:.1e}" for e in errs), "ok" if good else "FAIL", ""))
        compiled = linear_vjp(lp.get_recipe(name)).lower(*bf16).compile()
        jax.block_until_ready(compiled(*bf16))
        hlo = compiled.as_text().lower()
        missing = [t for t in TYPES[name] if t not in hlo]
        verdict, good = gemm_verdict(name, compiled_gemms(compiled.as_text()), platform)
        good &= not missing
        ok &= good
        rows.append((name, "auto, bf16", "", "", "", "ok" if good else "FAIL",
                     verdict + (f"; LOST types {missing}" if missing else "")))
    print_table(["recipe", "backend", "y err", "dx err", "dW err", "check", "optimized HLO GEMMs"], rows,
                title=f"relative error vs the reference on this device (<= {TOLERANCE:g}); "
                      "compiled GEMMs of the BF16 program")
    print("backend check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
