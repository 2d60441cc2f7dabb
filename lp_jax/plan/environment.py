"""The process environment for compiling for GPUs without one. Imports nothing: it must
run before JAX is imported."""
from __future__ import annotations

import importlib.util
import os

# JAX's CUDA plugins (CUDA 13 is what the gpu extra installs; a GPU machine may have 12).
PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def deviceless(environ=os.environ) -> None:
    """The CPU stays JAX's default backend, and the CUDA plugin skips its start-up check of
    the (absent) CUDA libraries' versions."""
    environ.setdefault("JAX_PLATFORMS", "cpu")
    environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def plugin_problem() -> str | None:
    """Why nothing can be compiled for a GPU here (JAX's CUDA plugin missing), or None."""
    for plugin in PLUGINS:
        try:
            if importlib.util.find_spec(plugin) is not None:
                return None
        except ModuleNotFoundError:
            continue
    return ("JAX's CUDA plugin is not installed; install it with pip install -e '.[gpu]' "
            "(JAX's CUDA 13 plugin for the installed JAX; no GPU is needed)")
