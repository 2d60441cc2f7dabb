"""Whole-tensor amaxes inside a ``shard_map``.

Inside a ``shard_map`` that is manual over some mesh axes, a traced array is one device's
piece of the logical tensor. A per-tensor scale (FP8-CS, NVFP4's tensor scale) comes by
default (``amax_scope`` "global") from the logical tensor's amax, as it does under the
partitioner, so the quantizers reduce their whole-tensor amax over the axes marked here.
With ``amax_scope`` "local" (Transformer Engine's: each rank scales the data it holds) the
axes marked as data-parallel ranks are left out: no all-reduce over them, and the scale
depends on how the batch is split. Block amaxes need nothing: blocks never straddle shards.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

AMAX_SCOPES = ("global", "local")

_MANUAL_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "lp_jax_manual_axes", default=())
_RANK_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "lp_jax_rank_axes", default=())
_AMAX_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "lp_jax_amax_scope", default="global")


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def manual_axes(axes, rank_axes=()) -> Iterator[None]:
    """Marks code traced inside a shard_map that is manual over mesh ``axes``; ``rank_axes``
    (among them) split the batch into data-parallel ranks, which a local amax leaves out."""
    with _set(_MANUAL_AXES, tuple(axes)), _set(_RANK_AXES, tuple(rank_axes)):
        yield


@contextlib.contextmanager
def amax_scope(scope: str) -> Iterator[None]:
    """The scope of the whole-tensor amaxes taken inside: "global" or "local" (a recipe's
    ``amax_scope``, set by the quantized GEMM around its quantizers)."""
    if scope not in AMAX_SCOPES:
        raise ValueError(f"amax_scope={scope!r} is not valid; expected one of {AMAX_SCOPES}")
    with _set(_AMAX_SCOPE, scope):
        yield


def reduced_axes() -> tuple[str, ...]:
    """The manual axes a whole-tensor amax is maxed over here: those of the scope that split
    anything (a max over a size-1 axis would still be an all-reduce, of one device each)."""
    axes = _MANUAL_AXES.get()
    if _AMAX_SCOPE.get() == "local":
        axes = tuple(a for a in axes if a not in _RANK_AXES.get())
    return tuple(a for a in axes if jax.lax.axis_size(a) > 1)


def tensor_amax(amax):
    """A whole-tensor amax computed on this device's piece, maxed over the manual axes the
    scope covers (not differentiated: a scale is a constant of the quantization)."""
    axes = reduced_axes()
    if not axes:
        return amax
    return max_over_devices(jax.lax.stop_gradient(amax), axes)


def max_over_devices(amax, axes):
    """The max of a per-device amax over mesh ``axes`` (one scalar all-reduce), NaN winning
    as it does in jnp.max: XLA's all-reduce(max) may drop a NaN, so it travels as +inf,
    which gives the same tensor scale (NaN and inf amaxes both give scale 1)."""
    amax = jnp.where(jnp.isnan(amax), jnp.float32(jnp.inf), amax)
    return jax.lax.pmax(amax, axes)
