"""On a GPU: does the compiled (optimized) program still quantize? Prints one line per recipe.

XLA's GPU pipeline may drop f32 -> fp8 -> f32 round trips as excess precision; the
quantized dot_general guards against it. This compiles a gradient step of a two-layer toy
on the current backend and looks for the low-precision types (or cuBLASLt FP8 GEMM calls)
in the optimized HLO. Exit status 1 if a recipe lost its quantization.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax as lp  # noqa: E402
from lp_jax import context  # noqa: E402

EXPECTED = {"fp8_cs": ("f8e4m3fn", "f8e5m2"), "mxfp8": ("f8e4m3fn",), "nvfp4": ("f4e2m1fn",)}


def optimized_hlo(recipe: str) -> str:
    dg = lp.dot_general(recipe)
    dims = (((1,), (0,)), ((), ()))

    def loss(w1, w2, x, key):
        with context.rng_scope(key):
            h = jax.nn.relu(dg(x, w1, dims))
            return jnp.mean(dg(h, w2, dims).astype(jnp.float32) ** 2)

    args = (jnp.ones((1024, 1024), jnp.float32), jnp.ones((1024, 1024), jnp.float32),
            jnp.ones((2048, 1024), jnp.bfloat16), jax.random.key(0))
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()


def main() -> int:
    print(f"backend: {jax.default_backend()} {jax.devices()[0].device_kind}")
    bad = 0
    for recipe, types in EXPECTED.items():
        hlo = optimized_hlo(recipe)
        found = [t for t in types if t in hlo]
        fp8_gemms = hlo.count("__cublas$lt$matmul$f8")
        ok = len(found) == len(types)
        bad += not ok
        print(f"{recipe:7s} {'ok ' if ok else 'LOST'} types present: {found} of {list(types)}; "
              f"cuBLASLt FP8 GEMM calls: {fp8_gemms}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
