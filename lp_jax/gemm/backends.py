"""Which GEMM implementation runs a recipe on this platform.

- "reference": any platform. Operands are quantized, then multiplied as their exact
  dequantized bf16 values with FP32 accumulation; tensor factors applied after. This is
  the definition every other backend is tested against.
- "xla_fp8": FP8 per-tensor operands go into ``lax.dot_general`` as real FP8 arrays with
  an FP32 result, which XLA lowers to cuBLASLt FP8 GEMMs on Hopper and later (also runs,
  slowly, on CPU, which is how it is tested here). Block formats use the reference path:
  Hopper has no block-scaled MMA.

"auto" picks "xla_fp8" on CUDA devices of compute capability 8.9 or newer, else
"reference". An explicitly requested backend is used as asked or raises; it never falls
back silently.
"""
from __future__ import annotations

import functools

import jax

BACKENDS = ("auto", "reference", "xla_fp8")


@functools.lru_cache(maxsize=None)
def _default_backend() -> str:
    device = jax.devices()[0]
    if device.platform == "gpu":
        capability = getattr(device, "compute_capability", "0.0")
        major, minor = (int(p) for p in str(capability).split(".")[:2])
        if (major, minor) >= (8, 9):
            return "xla_fp8"
    return "reference"


def resolve_backend(recipe) -> str:
    backend = recipe.backend
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; expected one of {BACKENDS}")
    return _default_backend() if backend == "auto" else backend
