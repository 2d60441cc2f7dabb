import os
import shutil
import tempfile

import pytest

from lp_jax.plan.environment import deviceless

# The suite runs on the CPU; where JAX's CUDA plugin is installed (the .[gpu] extra) it also
# compiles for described GPUs, which needs the plugin's start-up check of CUDA skipped.
# Before JAX is imported by any test module.
deviceless()


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run, shared by the xdist workers
    and the subprocesses the tests start (they inherit the environment): many tests compile
    the same tiny model's programs, and JAX then loads them instead of compiling them
    again. Results cannot change (the cache is keyed by the program, the JAX version and the
    compile options). A fresh folder per run unless JAX_COMPILATION_CACHE_DIR is set."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config._lp_jax_xla_cache = tempfile.mkdtemp(
            prefix="lp_jax_test_xla_cache_")


def pytest_unconfigure(config):
    folder = getattr(config, "_lp_jax_xla_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    """One tokenized-text cache for the session (each xdist worker has its own)."""
    return str(tmp_path_factory.mktemp("token_cache"))
