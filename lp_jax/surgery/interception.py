"""Scoped interception of ``jax.lax.dot_general`` and ``jnp.einsum``: how lp_jax reaches a
GEMM that a module computes by calling JAX itself (Hugging Face's Flax GPT-2 ``FlaxConv1D``,
MaxText's NNX ``DenseGeneral``, Linen's ``nn.Dense`` and ``nn.Einsum``), whose code cannot be
edited.

While a module's method runs inside ``frame(handler, owned_shapes)``, a call it makes to
``jax.lax.dot_general`` or ``jnp.einsum`` whose weight operand (the right one) has the shape
of one of the module's own parameters, or that shape reversed (a transposed kernel), is
handed to ``handler``; anything else, any call from a nested module's frame, and any call
made while a handler runs (lp_jax's own GEMM calls JAX too) reaches JAX unchanged. The two
functions are replaced on the ``jax.lax`` and ``jax.numpy`` modules only while some frame
is open, and the frames are per thread, so code outside a frame never sees the change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable

import jax
import jax.numpy as jnp

_ORIGINAL_DOT_GENERAL = jax.lax.dot_general
_ORIGINAL_EINSUM = jnp.einsum
_local = threading.local()
_lock = threading.Lock()
_open_frames = 0


@dataclasses.dataclass
class Frame:
    """One module's method call. ``handler(op, args, kwargs)`` runs an intercepted GEMM
    (``op``: "dot_general" or "einsum") and returns its result; ``owned_shapes()`` gives the
    shapes of the module's own parameters when a call is seen (Linen creates them during the
    call). ``calls`` counts the GEMMs handed to the handler."""

    handler: Callable
    owned_shapes: Callable[[], list]
    calls: int = 0


def _stack() -> list:
    if not hasattr(_local, "frames"):
        _local.frames, _local.in_handler = [], False
    return _local.frames


def _owned(frame: Frame, weight) -> bool:
    shape = tuple(getattr(weight, "shape", ()))
    if len(shape) < 2:
        return False
    return any(shape == tuple(s) or shape == tuple(reversed(s)) for s in frame.owned_shapes())


def _handled(op: str, weight, args, kwargs):
    frames = _stack()
    if not frames or _local.in_handler or frames[-1] is None or not _owned(frames[-1], weight):
        return NotImplemented
    frame = frames[-1]
    _local.in_handler = True
    try:
        out = frame.handler(op, args, kwargs)
    finally:
        _local.in_handler = False
    if out is not NotImplemented:
        frame.calls += 1
    return out


def _dot_general(lhs, rhs, dimension_numbers, *args, **kwargs):
    out = _handled("dot_general", rhs, (lhs, rhs, dimension_numbers, *args), kwargs)
    if out is NotImplemented:
        return _ORIGINAL_DOT_GENERAL(lhs, rhs, dimension_numbers, *args, **kwargs)
    return out


def _einsum(subscripts, *operands, **kwargs):
    weight = operands[1] if len(operands) == 2 and isinstance(subscripts, str) else None
    out = NotImplemented if weight is None else _handled("einsum", weight, (subscripts, *operands), kwargs)
    if out is NotImplemented:
        return _ORIGINAL_EINSUM(subscripts, *operands, **kwargs)
    return out


def original_einsum(*args, **kwargs):
    """``jnp.einsum`` as JAX defines it (for a handler: the name may be replaced meanwhile)."""
    return _ORIGINAL_EINSUM(*args, **kwargs)


def original_dot_general(*args, **kwargs):
    return _ORIGINAL_DOT_GENERAL(*args, **kwargs)


@contextlib.contextmanager
def frame(f: Frame | None):
    """Runs the body as one module's call (``None``: a module whose GEMMs are left alone,
    which still hides the frames around it)."""
    global _open_frames
    with _lock:
        if _open_frames == 0:
            jax.lax.dot_general, jnp.einsum = _dot_general, _einsum
        _open_frames += 1
    _stack().append(f)
    try:
        yield f
    finally:
        _stack().pop()
        with _lock:
            _open_frames -= 1
            if _open_frames == 0:
                jax.lax.dot_general, jnp.einsum = _ORIGINAL_DOT_GENERAL, _ORIGINAL_EINSUM
