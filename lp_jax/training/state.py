"""The train state: building it (fresh or as a restore target), sharding it, and placing
batches on the device mesh.

The state is a plain dict, the tree that checkpoints hold:

    params       nnx.State of the model's nnx.Param (FP32 master weights)
    rest         the model's other variables (empty for the Llama here)
    opt_state    optax AdamW state (FP32 moments, update count)
    step         optimizer steps taken, skipped ones included (= batches consumed)
    opt_steps    updates actually applied (drives the learning-rate schedule)
    nonfinite_steps  steps skipped because the loss or gradient norm was not finite
    rng          key data of the base key (stochastic-rounding bits derive from it)

Nothing in it depends on the precision recipe: recipes live in the graphdef.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")  # both shard the batch; fsdp also shards the state


def make_mesh(data_parallel: int, fsdp: int) -> Mesh:
    devices = np.asarray(jax.devices()[: data_parallel * fsdp]).reshape(data_parallel, fsdp)
    return Mesh(devices, MESH_AXES)


def sharding_for(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """FSDP rule: shard the largest axis the fsdp size divides; else replicate."""
    fsdp = mesh.shape["fsdp"]
    spec = [None] * len(shape)
    if fsdp > 1:
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp == 0:
                spec[axis] = "fsdp"
                break
    return NamedSharding(mesh, P(*spec))


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda x: sharding_for(tuple(x.shape), mesh), abstract_state)


def split_model(model: nnx.Module):
    """(graphdef, params, rest) of a model (concrete or abstract)."""
    return nnx.split(model, nnx.Param, ...)


def abstract_state(graphdef_params_rest, tx, seed: int) -> dict:
    """The train state's shapes and dtypes, without allocating it."""
    _, params, rest = graphdef_params_rest
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return {"params": params, "rest": rest, "opt_state": jax.eval_shape(tx.init, params),
            "step": scalar, "opt_steps": scalar, "nonfinite_steps": scalar,
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(seed)))}


def init_state(build_model: Callable[[], nnx.Module], tx, seed: int, shardings: Any) -> dict:
    """A fresh train state, created directly with its shardings (an 8B model is never
    materialized on one device first)."""

    def init():
        _, params, rest = split_model(build_model())
        zero = jnp.zeros((), jnp.int32)
        return {"params": params, "rest": rest, "opt_state": tx.init(params), "step": zero,
                "opt_steps": zero, "nonfinite_steps": zero,
                "rng": jax.random.key_data(jax.random.key(seed))}

    return jax.jit(init, out_shardings=shardings)()


def place_batch(batch: dict[str, np.ndarray], accum_steps: int, mesh: Mesh) -> dict[str, jax.Array]:
    """[global, L] host arrays -> [accum, global/accum, L] device arrays, micro-batches
    sharded over the data-parallel ranks."""
    sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        out[key] = jax.device_put(value.reshape(accum_steps, -1, *value.shape[1:]), sharding)
    return out
