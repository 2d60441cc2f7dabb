"""Whole-tensor amaxes inside a ``shard_map``.

Inside a ``shard_map`` that is manual over some mesh axes, a traced array is one device's
piece of the logical tensor. A per-tensor scale (FP8-CS, NVFP4's tensor scale) must still
come from the logical tensor's amax, as it does under the partitioner, so the quantizers
reduce their whole-tensor amax over the axes marked here. Block amaxes need nothing: blocks
never straddle shards.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

_MANUAL_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "lp_jax_manual_axes", default=())


@contextlib.contextmanager
def manual_axes(axes) -> Iterator[None]:
    """Marks code traced inside a shard_map that is manual over mesh ``axes``."""
    token = _MANUAL_AXES.set(tuple(axes))
    try:
        yield
    finally:
        _MANUAL_AXES.reset(token)


def tensor_amax(amax):
    """A whole-tensor amax computed on this device's piece, maxed over the manual axes
    (not differentiated: a scale is a constant of the quantization)."""
    axes = _MANUAL_AXES.get()
    if not axes:
        return amax
    return max_over_devices(jax.lax.stop_gradient(amax), axes)


def max_over_devices(amax, axes):
    """The max of a per-device amax over mesh ``axes`` (one scalar all-reduce), NaN winning
    as it does in jnp.max: XLA's all-reduce(max) may drop a NaN, so it travels as +inf,
    which gives the same tensor scale (NaN and inf amaxes both give scale 1)."""
    amax = jnp.where(jnp.isnan(amax), jnp.float32(jnp.inf), amax)
    return jax.lax.pmax(amax, axes)
