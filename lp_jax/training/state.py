"""The train state: building it (fresh or as a restore target), sharding it, and placing
batches on the device mesh.

The state is a plain dict, the tree that checkpoints hold:

    params       nnx.State of the model's nnx.Param (FP32 master weights)
    rest         the model's other variables (empty for the Llama here)
    opt_state    optax AdamW state (FP32 moments, update count)
    step         optimizer steps taken, skipped ones included (= batches consumed)
    opt_steps    updates actually applied (drives the learning-rate schedule)
    nonfinite_steps  steps skipped because the loss or gradient norm was not finite
    nonfinite_in_a_row  the skipped steps since the last finite one (a resume goes on
                 counting; checkpoints that lack it restore it as 0)
    rng          key data of the base key (stochastic-rounding bits derive from it)

Nothing in it depends on the precision recipe: recipes live in the graphdef.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lp_jax.parallel.partitioning import batch_sharding


def split_model(model: nnx.Module):
    """(graphdef, params, rest) of a model (concrete or abstract)."""
    return nnx.split(model, nnx.Param, ...)


def abstract_state(graphdef_params_rest, tx, seed: int) -> dict:
    """The train state's shapes and dtypes, without allocating it."""
    _, params, rest = graphdef_params_rest
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return {"params": params, "rest": rest, "opt_state": jax.eval_shape(tx.init, params),
            "step": scalar, "opt_steps": scalar, "nonfinite_steps": scalar,
            "nonfinite_in_a_row": scalar,
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(seed)))}


def init_state(build_model: Callable[[], nnx.Module], tx, seed: int, shardings: Any) -> dict:
    """A fresh train state, created directly with its shardings (an 8B model is never
    materialized on one device first)."""

    def init():
        _, params, rest = split_model(build_model())
        zero = jnp.zeros((), jnp.int32)
        return {"params": params, "rest": rest, "opt_state": tx.init(params), "step": zero,
                "opt_steps": zero, "nonfinite_steps": zero, "nonfinite_in_a_row": zero,
                "rng": jax.random.key_data(jax.random.key(seed))}

    return jax.jit(init, out_shardings=shardings)()


def place_batch(batch: dict[str, np.ndarray], accum_steps: int, mesh: Mesh,
                global_batch_size: int | None = None) -> dict[str, jax.Array]:
    """Host arrays -> global [accum, global/accum, L] arrays, micro-batches sharded over the
    data-parallel ranks (mesh.data x mesh.fsdp).

    One process: ``batch`` is the global batch [global, L]. Several processes: it holds this
    process's rows of it (``data.host_rows``, in the same order) and ``global_batch_size``
    is the total; each process contributes only the shards its own devices hold.
    """
    sharding = batch_sharding(mesh)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        local = value.reshape(accum_steps, -1, *value.shape[1:])
        rows = (global_batch_size or value.shape[0]) // accum_steps
        out[key] = jax.make_array_from_process_local_data(
            sharding, local, (accum_steps, rows, *value.shape[1:]))
    return out
