"""The JAX features lp_jax's GPU work relies on, across the supported JAX versions.

lp_jax supports ``OLDEST_JAX`` up to the newest release (docs/jax_versions.md). Code that
needs a name some supported JAX lacks gets it through ``jax_api`` (or ``mosaic_gpu``), which
says in one line which JAX it needs instead of an AttributeError deep in a kernel.
"""
from __future__ import annotations

import importlib

import jax

OLDEST_JAX = "0.11.2"  # pyproject.toml's floor; CI tests it in its own environment

_MOSAIC_GPU = "jax.experimental.pallas.mosaic_gpu"
# Names in jax.experimental.pallas.mosaic_gpu from JAX 0.12 on, not in OLDEST_JAX.
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
