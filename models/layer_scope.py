"""Which transformer layer is being traced: the one hook a model gives to precision code.

A model wraps each layer's call in ``layer_scope(i)`` (``i`` may be a traced scan index).
It says which layer runs and nothing about formats; code that needs per-layer behaviour
(lp_jax's stochastic-rounding bits, a stacked Linear's FiLj choice) reads it at trace time.
A Python context variable, not JAX state: it costs nothing at run time and leaves the
model's state tree untouched.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


class LayerFrame:
    """One entry into ``layer_scope``: a fresh object each time, so a reader can tell two
    entries of the same layer apart (and count what it traces inside each)."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: Any):
        self.index = index  # int or traced int32 scalar


_FRAME: contextvars.ContextVar[LayerFrame | None] = contextvars.ContextVar("layer_frame", default=None)


@contextlib.contextmanager
def layer_scope(layer) -> Iterator[None]:
    """Marks the transformer layer being traced (an int or a traced scan index)."""
    token = _FRAME.set(LayerFrame(layer))
    try:
        yield
    finally:
        _FRAME.reset(token)


def current_frame() -> LayerFrame | None:
    """The innermost open ``layer_scope`` entry, or None."""
    return _FRAME.get()


def current_layer():
    """The layer index given to the innermost layer_scope (maybe traced), or None."""
    frame = _FRAME.get()
    return None if frame is None else frame.index
