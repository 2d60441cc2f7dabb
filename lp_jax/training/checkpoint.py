"""Orbax checkpoints of a whole run: model, optimizer, step, RNG and data iterator together.

One checkpoint is a Composite of three items:

- ``state``: the train-state tree (FP32 params, other model state, optimizer state, step
  counters, the RNG key data) via StandardSave. Its structure does not depend on the
  precision recipe (recipes swap functions, not parameters), so a run may change recipe
  across a resume;
- ``data``: grain's iterator state (a position), so the resumed run reads exactly the
  batches it would have read (one file per process; since every process is at the same
  batch index, a run resumed with another process count takes process 0's);
- ``meta``: JSON with the config and the recipe in force, for people and for checks.

Restores go into an abstract target (shapes, dtypes, shardings from ``nnx.eval_shape``),
so a resumed 8B run never initializes weights it is about to overwrite. The target's
shardings may come from another mesh than the one that saved: Orbax reads each device's
slices from the saved arrays, so a run saved on (data 2, fsdp 4) resumes on (fsdp 8).
With several processes every one calls save and restore (Orbax writes each array's
shards from the process that holds them and coordinates the commit); the run folder must
be on a file system they all see.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp


class PoisonedStateError(RuntimeError):
    """Raised instead of writing a checkpoint whose parameters or moments are not finite."""


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Checkpointer:
    """A CheckpointManager over ``directory`` keeping the last ``keep`` checkpoints."""

    def __init__(self, directory: str | os.PathLike, keep: int, async_save: bool = True):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any, meta: dict) -> None:
        """Saves (asynchronously if enabled); never a non-finite state."""
        import grain

        if not bool(_all_finite(state)):
            raise PoisonedStateError(
                f"refusing to save step {step}: the train state holds NaN or inf "
                "(the non-finite-step guard should have prevented this)")
        ocp = self._ocp
        items = {"state": ocp.args.StandardSave(state),
                 "meta": ocp.args.JsonSave(meta)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        # force: our loop decides when to save (every N, end, stop_at, signals).
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> tuple[Any, dict]:
        """(state, meta) of ``step``; the data iterator is restored in place."""
        import grain

        ocp = self._ocp
        items = {"state": ocp.args.StandardRestore(abstract_state),
                 "meta": ocp.args.JsonRestore()}
        data_dir = os.path.join(self.directory, str(step), "data")
        own = os.path.join(data_dir, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        other = None
        if data_iterator is not None:
            if os.path.exists(own):
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            else:  # saved by another number of processes: all were at the same position
                other = sorted(glob.glob(os.path.join(data_dir, "process_0-of-*.json")))
                if not other:
                    raise FileNotFoundError(f"checkpoint {step} in {self.directory} has no data "
                                            f"iterator state ({own} is missing)")
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if other:
            with open(other[0]) as f:
                data_iterator.set_state(json.load(f))
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs of a tree (with shardings, if given) as a restore target."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
