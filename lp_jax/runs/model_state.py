"""A model's weights out of a checkpoint folder's item ``state``, without the optimizer
moments: what evaluation, export and ``init.checkpoint`` read."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from lp_jax.errors import UserError
from models.orbax_quiet import abandoned_reads_hushed, orbax_logs


def _on_device(abstract_tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_tree)


def restore_model_state(abstract_model: Any, checkpoint_dir: str, step: int | None = None):
    """Restores the model from item `state` of an Orbax CheckpointManager folder (latest
    step by default); returns the concrete model and the step read.

    Two layouts of that item are read:
    - the trainer's train-state dict {"params": nnx.State of the nnx.Params, "rest": the
      other variables, "opt_state", "step", ...}: only params (and a non-empty rest) are
      restored, a partial restore that never reads the optimizer moments (twice the
      parameters' size);
    - the model's whole nnx.State.
    """
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"{checkpoint_dir}: no checkpoint folder")
    # Orbax warns about every item it is not asked for (the trainer's `data`, `meta`);
    # skipping them is the point here, so its warnings are held back while reading. A
    # failed read's abandoned array reads would each print a traceback (``orbax_quiet``).
    with orbax_logs(logging.ERROR), abandoned_reads_hushed():
        # A PyTree handler reads the item whether it was written with StandardSave or
        # PyTreeSave, and knows its saved structure before anything is restored.
        manager = ocp.CheckpointManager(os.path.realpath(checkpoint_dir),
                                        item_handlers={"state": ocp.PyTreeCheckpointHandler()})
        try:
            step = manager.latest_step() if step is None else step
            if step is None:
                raise UserError(f"{checkpoint_dir}: no checkpoint saved yet")
            try:
                saved = manager.item_metadata(step)["state"]
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise UserError(f"{checkpoint_dir} step {step}: no readable item 'state' ({e})") from None
            if saved is None:
                raise UserError(f"{checkpoint_dir} step {step}: no readable item 'state'")
            tree = getattr(saved, "tree", saved)
            if isinstance(tree, dict) and "params" in tree:
                graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
                target = {"params": _on_device(params)}
                if jax.tree.leaves(rest):
                    target["rest"] = _on_device(rest)
                partial = True
            else:
                graphdef, target = nnx.split(abstract_model)
                target = _on_device(target)
                partial = False
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=partial)
            try:
                restored = manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            except Exception as e:  # TensorStore, Orbax and OS errors alike: the item cannot be read
                # One line; TensorStore appends a "See full ... details" of no use to anyone.
                text = " ".join(str(e).split()).split(" See full TensorStore details")[0] or type(e).__name__
                raise UserError(f"{checkpoint_dir} step {step}: cannot read item 'state' "
                                f"({text[:200]})") from None
        finally:
            manager.close()
    if partial:
        model = nnx.merge(graphdef, restored["params"], restored.get("rest", rest))
    else:
        model = nnx.merge(graphdef, restored)
    return model, step
