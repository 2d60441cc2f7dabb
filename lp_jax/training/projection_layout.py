"""Resuming from a checkpoint of the other projection layout: ``model.fused_projections``
changed, or checkpoints written with separate q/k/v and gate/up before a config fused them.

The train state is restored in the layout it was saved in and converted exactly (the Adam
moments as the parameters: joining and splitting only move values), on the state's own
shardings (models.fused_projections).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import jax

from models.fused_projections import layout_name, relayout


def saved_fused(meta: dict) -> bool:
    """Whether a checkpoint's model has fused projections (one that records no model, or
    no such field, was written with separate ones)."""
    model = meta.get("model") if isinstance(meta, dict) else None
    return bool(model.get("fused_projections", False)) if isinstance(model, dict) else False


def restore_in_saved_layout(model_config, target: Any, target_in_layout: Callable[[bool], Any]):
    """``saved_as`` for ``Checkpointer.restore_newest``: for a step saved in the other
    layout, (``target_in_layout(saved)``, its conversion to ``target``'s structure and
    shardings); None for a step in ``model_config``'s own."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, target)

    def convert(state):
        # Donated, so that the leaves that keep their shape reuse their buffers; the joined
        # and split ones cannot, which JAX would warn about.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            return jax.jit(lambda s: relayout(s, target, model_config), out_shardings=shardings,
                           donate_argnums=0)(state)

    def saved_as(step: int, meta: dict):
        if saved_fused(meta) == model_config.fused_projections:
            return None
        return target_in_layout(saved_fused(meta)), convert

    return saved_as


def conversion_message(step: int, meta: dict, model_config) -> str | None:
    """The line that says a resumed checkpoint was converted (None when it was not)."""
    saved, now = saved_fused(meta), model_config.fused_projections
    if saved == now:
        return None
    return (f"checkpoint {step} holds {layout_name(saved)} projections: converted exactly to "
            f"{layout_name(now)} (model.fused_projections={str(now).lower()})")
