"""Trace-time context for stochastic rounding: which step and which layer is running.

Stochastic rounding (SR) needs random bits that depend on (seed, step, layer, operand) so
that a resumed run draws exactly the bits it would have drawn. The training step opens
``rng_scope(key)`` around the forward pass; the model marks each layer with
``models.layer_scope.layer_scope(i)``; each quantized ``dot_general`` reads ``site_key()``
while its forward is traced and keeps the key as a custom_vjp residual, so the backward
(traced later, outside these scopes) uses the same bits.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from typing import Iterator

import jax
import jax.numpy as jnp

from models.layer_scope import current_frame, current_layer  # noqa: F401  (read by surgery, telemetry)


@dataclasses.dataclass
class _RngScope:
    key: jax.Array
    site: int = 0  # quantized GEMM calls traced outside any layer scope
    # Calls traced inside each layer-scope entry, counted from 0 per entry.
    layer_sites: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)


_SCOPE: contextvars.ContextVar[_RngScope | None] = contextvars.ContextVar("lp_jax_rng_scope", default=None)

# Used when no rng_scope is open (for example a gradient taken outside the trainer):
# deterministic, so results are reproducible, but the same for every step. The trainer
# always opens a scope.
_DEFAULT_SEED = 0
# Site counts of layer scopes entered with no rng_scope open.
_UNSCOPED_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def rng_scope(key) -> Iterator[None]:
    """Sets the base key for stochastic rounding in quantized GEMMs traced inside."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # raw uint32 key data, as jax.random.PRNGKey gives
    token = _SCOPE.set(_RngScope(key=key))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _next_site(scope: _RngScope | None, frame) -> int:
    if frame is None:
        site, scope.site = scope.site, scope.site + 1
        return site
    counts = _UNSCOPED_SITES if scope is None else scope.layer_sites
    site = counts.get(frame, 0)
    counts[frame] = site + 1
    return site


def site_key():
    """A fresh key for the next quantized GEMM call site, from (key, layer, site)."""
    scope, frame = _SCOPE.get(), current_frame()
    if scope is None and frame is None:
        # No scope: one fixed key. Counting sites here would make the bits depend on
        # how many traces the process ran before, which a resumed run cannot repeat.
        return jax.random.key(_DEFAULT_SEED)
    key = scope.key if scope is not None else jax.random.key(_DEFAULT_SEED)
    layer = 0 if frame is None else frame.index
    key = jax.random.fold_in(key, jnp.asarray(layer, jnp.uint32))
    return jax.random.fold_in(key, _next_site(scope, frame))
