"""A Linear's kernel with its GEMM copies made ahead: weights quantized once per step.

Within one optimizer step the weights do not change, yet a micro-batch loop that calls the
quantized dot_general re-derives every weight's copies (the cast to the compute dtype, the
tensor amax, the scale, the FP8 or FP4 bytes and their transposed copy) in every
micro-batch. Transformer Engine keeps its FP8 weights across micro-batches for the same
reason. ``prepare(recipe, w, x_dtype)`` makes the copies once; the dot_general reads them
from the ``PreparedKernel`` it is handed in place of the kernel and returns the weight
gradient for ``w`` as before. The copies are the ones the dot_general would make itself
(``weight_operands`` is its forward's own weight path), so every product, and every
gradient, is bit for bit the same.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lp_jax.gemm.operands import Pending, operand_pair, shares_bytes, stored, weight_source
from lp_jax.numerics.manual_axes import amax_scope
from lp_jax.recipes import Recipe


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedKernel:
    """``w`` (the master kernel [in, out], what the gradient is taken for) with the GEMM
    copies of it that ``recipe`` asks for at activations of ``x_dtype``: ``fw`` for the
    forward, ``dgrad_w`` for the backward's input gradient (None: ``fw`` serves both)."""

    w: jax.Array
    fw: object
    dgrad_w: object
    recipe: Recipe = dataclasses.field(metadata=dict(static=True))
    x_dtype: str = dataclasses.field(metadata=dict(static=True))

    # nnx.Linear reads its kernel as ``self.kernel[...]``.
    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"a PreparedKernel is read whole (kernel[...]), not kernel[{index!r}]")
        return self

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype

    def operands(self):
        """(fprop copy, dgrad copy)."""
        return self.fw, self.fw if self.dgrad_w is None else self.dgrad_w


def weight_operands(recipe: Recipe, w, x_dtype, *, materialize: bool = False):
    """(fprop copy, dgrad copy) of the kernel ``w`` [K, N] for activations of ``x_dtype``, as
    the quantized dot_general's forward makes them: the dgrad copy packed for the backward,
    the fprop copy packed or left to the backend to quantize (``Pending``) unless
    ``materialize`` (then packed too: a backend reads the same values from either)."""
    r = recipe
    wc = weight_source(r, w, x_dtype)
    with amax_scope(r.amax_scope):
        if shares_bytes(r.fprop_w, r.dgrad_w):
            fw = stored(wc, r.fprop_w, axis=0)
            return fw, fw
        fw, dgrad_w = operand_pair(wc, r.fprop_w, 0, r.dgrad_w, 1, keep_b=True)
        if materialize and isinstance(fw, Pending):
            fw = stored(fw.t, fw.spec, fw.axis, fw.key)
        return fw, dgrad_w


def prepare(recipe: Recipe, w, x_dtype) -> PreparedKernel:
    """``w`` [K, N] with its copies for ``recipe`` at activations of ``x_dtype``, made now.
    The copies carry no gradient: the weight gradient reaches ``w`` through the GEMM."""
    x_dtype = jnp.dtype(x_dtype)
    fw, dgrad_w = jax.lax.stop_gradient(weight_operands(recipe, w, x_dtype, materialize=True))
    shared = shares_bytes(recipe.fprop_w, recipe.dgrad_w)
    return PreparedKernel(w, fw, None if shared else dgrad_w, recipe, x_dtype.name)
