"""Trace-time context for stochastic rounding: which step and which layer is running.

Stochastic rounding (SR) needs random bits that depend on (seed, step, layer, operand)
so that a resumed run draws exactly the bits it would have drawn. Threading a PRNG key
through every model call would put quantization plumbing into model code, so instead:

- the training step opens ``rng_scope(key)`` around the forward pass (``key`` a traced
  JAX key derived from seed and step, and micro-batch when accumulating);
- a model that wants per-layer bits inside ``nnx.scan``/``lax.scan`` wraps each layer in
  ``layer_scope(i)`` (``i`` may be a traced scan index). This is the only hook a model
  needs, and it is precision-agnostic: it says which layer runs, nothing about formats;
- each quantized ``dot_general`` call reads ``site_key()`` while its forward is traced.
  The key is passed into the custom_vjp as an argument and kept as a residual, so the
  backward (traced later, outside these scopes) uses the same bits.

These are Python context variables read at trace time, not JAX state: they cost nothing
at run time and leave the model's state tree untouched.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class _Scope:
    key: Any  # a typed JAX key array, or None when no rng_scope is open
    layer: Any  # int or traced int32 scalar
    site: int  # counts quantized GEMM calls traced since the layer scope opened
    in_layer: bool = False  # whether a layer_scope is open


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("lp_jax_scope", default=None)

# Used when no rng_scope is open (for example a gradient taken outside the trainer):
# deterministic, so results are reproducible, but the same for every step. The trainer
# always opens a scope.
_DEFAULT_SEED = 0


@contextlib.contextmanager
def rng_scope(key) -> Iterator[None]:
    """Sets the base key for stochastic rounding in quantized GEMMs traced inside."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # raw uint32 key data, as jax.random.PRNGKey gives
    token = _SCOPE.set(_Scope(key=key, layer=0, site=0))
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def layer_scope(layer) -> Iterator[None]:
    """Marks the transformer layer being traced (an int or a traced scan index)."""
    outer = _SCOPE.get()
    token = _SCOPE.set(_Scope(key=None if outer is None else outer.key, layer=layer, site=0,
                              in_layer=True))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_layer():
    """The layer index given to the innermost layer_scope (maybe traced), or None."""
    scope = _SCOPE.get()
    return scope.layer if scope is not None and scope.in_layer else None


def site_key():
    """A fresh key for the next quantized GEMM call site, from (key, layer, site)."""
    scope = _SCOPE.get()
    if scope is None:
        # No scope: one fixed key. Counting sites here would make the bits depend on
        # how many traces the process ran before, which a resumed run cannot repeat.
        return jax.random.key(_DEFAULT_SEED)
    key = scope.key if scope.key is not None else jax.random.key(_DEFAULT_SEED)
    key = jax.random.fold_in(key, jnp.asarray(scope.layer, jnp.uint32))
    key = jax.random.fold_in(key, scope.site)
    scope.site += 1
    return key


# ------------------------------------------------------------------ manual mesh axes
# Inside a ``shard_map`` (the trainer's data-parallel gradient accumulation), a traced
# array is one device's piece of the logical tensor along the manual axes. A per-tensor
# scale (FP8-CS, NVFP4's tensor scale) must still come from the logical tensor's amax, as
# it does under the partitioner, so the quantizers reduce their whole-tensor amax over
# these axes. Block amaxes need nothing: blocks never straddle shards.
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
