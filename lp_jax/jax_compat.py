"""The JAX features lp_jax's GPU work relies on, across the supported JAX versions.

lp_jax supports JAX 0.11.2 (what the GPU machines run) up to the newest release.
``jax.nn.scaled_matmul`` (cuBLAS block-scaled GEMM), ``lax.platform_dependent``, Pallas
Mosaic GPU (``plgpu.kernel``, ``CompilerParams``) and its CPU interpreter
(``InterpretGPUParams``) exist on all of them (tests/test_jax_apis.py runs on the oldest
and the newest). A few Mosaic GPU names came with JAX 0.12; code that needs one gets it
through ``jax_api``, which says in one line which JAX it needs instead of an
AttributeError deep in a kernel (docs/jax_versions.md).
"""
from __future__ import annotations

import importlib

import jax

OLDEST_JAX = "0.11.2"  # pyproject.toml's floor; .ci/run tests it in its own environment

_MOSAIC_GPU = "jax.experimental.pallas.mosaic_gpu"
# In jax.experimental.pallas.mosaic_gpu on JAX 0.12.0.1, not on 0.11.2 (no release between).
MOSAIC_GPU_SINCE_0_12 = ("alloc_semaphore", "barrier_arrive_and_wait", "im2col_ref", "max", "min",
                         "prod", "store", "sum")
_SINCE = {f"{_MOSAIC_GPU}.{name}": "0.12" for name in MOSAIC_GPU_SINCE_0_12}


class JaxVersionError(RuntimeError):
    """A JAX feature this installed JAX does not have."""


def jax_api(path: str):
    """The object at the dotted ``path`` (e.g. "jax.experimental.pallas.mosaic_gpu.sum").

    Raises JaxVersionError with one line, "PATH needs JAX >= X; this is JAX Y", where this
    JAX lacks it (or "PATH is not in this JAX" for a name not known to come later).
    """
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        since = _SINCE.get(path)
        need = f"needs JAX >= {since}" if since else "is not in this JAX"
        raise JaxVersionError(f"{path} {need}; this is JAX {jax.__version__}") from None


def mosaic_gpu(name: str):
    """``jax.experimental.pallas.mosaic_gpu.<name>`` (plgpu), or one line saying which JAX has it."""
    return jax_api(f"{_MOSAIC_GPU}.{name}")
