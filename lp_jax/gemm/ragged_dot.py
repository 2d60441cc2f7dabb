"""The quantized grouped GEMM of mixture-of-experts layers: ``jax.lax.ragged_dot`` in a recipe.

``lp.ragged_dot(recipe)(lhs[M, K], rhs[G, K, N], group_sizes[G])``: rows ``lhs`` sorted by
group, group ``g`` (``group_sizes[g]`` consecutive rows) multiplied by ``rhs[g]``. Each group
is quantized on its own, as Transformer Engine's GroupedLinear does: its output, dgrad and
wgrad are, bit for bit, what ``lp.dot_general(recipe)`` gives on that group's rows
zero-padded to its window (``window_sizes``: the smallest of 128, 256, 512, ... rows, or
M rounded up to 128, that holds them). Padding with zero rows changes no quantized value (a
tensor amax, a block amax and the RHT of a zero row are zero), so a block along the tokens
(the wgrad copies: 1x128, 1x32, 1x16 blocks, 16-row RHT tiles) starts at the group's first
row and never holds another expert's rows, and FP8-CS's and NVFP4's tensor scales are the
group's own. Against ``lp.dot_general`` on the group's rows alone, without stochastic
rounding, the output and dgrad are the same bits; the wgrad, a sum over the group's rows,
may differ in the order XLA:CPU adds its FP32 partial sums over the window's rows rather
than the group's (the quantized values are the same). With stochastic rounding, group
``g`` draws the bits ``lp.dot_general`` draws on its padded rows under the key
``fold_in(k, g)``, where ``k`` is the grouped call's own site key (``lp_jax.context``):
every group's bits differ, and a resumed run draws the same ones. Where ``rhs`` holds one
expert rank's groups (expert parallelism), ``first_group`` is the global index of its first,
so group ``g`` draws the bits it draws on one device.

The emulation (any platform) runs each group in its window (a ``lax.switch`` over the
window lengths), unrolled up to ``UNROLLED_GROUPS`` groups and in a ``lax.scan`` beyond:
at most about twice the rows of one dense GEMM plus 128 per group, where a window of M rows
per group would be G times.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax import context
from lp_jax.gemm.dot_general import _needs_key, dot_general
from lp_jax.recipes import Recipe

_LINEAR = (((1,), (0,)), ((), ()))
# Up to this many groups run unrolled: XLA:CPU runs the backward of a scan over them about
# 13x slower than the same groups unrolled (MXFP8, 8 groups of 4096 rows in all); more are
# scanned, which keeps the compile small.
UNROLLED_GROUPS = 32


@dataclasses.dataclass(frozen=True)
class LowPrecisionRaggedDot:
    """A ``jax.lax.ragged_dot`` that runs each group's GEMMs through ``dot_general`` (an
    ``lp.dot_general`` or a layer-policy one: it is called once per group, inside the
    layer scope of the caller, so FiLj applies to experts as to Linears)."""

    dot_general: object
    # The kernel comes in its parameter dtype (FP32 masters) and is cast by the dot_general,
    # so its gradient stays FP32 (as KeepKernelDtype does for Linears): a grouped module
    # reads this to pass its kernel uncast.
    keeps_kernel_dtype = True
    # Takes ``first_group``: the global index of rhs's first group when rhs holds one expert
    # rank's experts (expert parallelism, models.moe_dispatch), for the groups' SR keys.
    takes_first_group = True

    @property
    def recipe(self) -> Recipe:
        return self.dot_general.recipe

    def __call__(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                 group_offset=None, first_group=0):
        _check(lhs, rhs, group_sizes, group_offset)
        m, k = lhs.shape
        out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
        sizes = group_sizes.astype(jnp.int32)
        starts = jnp.cumsum(sizes) - sizes
        windows = window_sizes(m)
        # The padding keeps every window's dynamic slice in bounds (a clamped slice would
        # shift its rows).
        x_pad = jnp.concatenate([lhs, jnp.zeros((windows[-1], k), lhs.dtype)])
        key = context.site_key() if _needs_key(self.recipe) else None

        def window(rows, out, g, w_g, start, size):
            in_group = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < size
            x_g = jnp.where(in_group, lax.dynamic_slice_in_dim(x_pad, start, rows), 0)
            scope = (context.rng_scope(jax.random.fold_in(key, g)) if key is not None
                     else contextlib.nullcontext())
            with scope:
                y_g = self.dot_general(x_g, w_g, _LINEAR, preferred_element_type=out_dtype)
            kept = lax.dynamic_slice_in_dim(out, start, rows)
            return lax.dynamic_update_slice_in_dim(out, jnp.where(in_group, y_g.astype(out_dtype), kept), start, 0)

        branches = [functools.partial(window, rows) for rows in windows]

        def group(out, xs):
            g, w_g, start, size = xs
            # The smallest window that holds the group: only that branch runs.
            which = jnp.searchsorted(jnp.asarray(windows), size)
            return lax.switch(which, branches, out, g, w_g, start, size), None

        out = jnp.zeros((m + windows[-1], rhs.shape[2]), out_dtype)
        groups = jnp.arange(rhs.shape[0], dtype=jnp.uint32) + jnp.asarray(first_group, jnp.uint32)
        if rhs.shape[0] <= UNROLLED_GROUPS:
            for g in range(rhs.shape[0]):
                out, _ = group(out, (groups[g], rhs[g], starts[g], sizes[g]))
        else:
            out, _ = lax.scan(group, out, (groups, rhs, starts, sizes))
        return out[:m]


def window_sizes(rows: int) -> tuple[int, ...]:
    """The window lengths a group of at most ``rows`` rows runs in: 128, 256, 512, ... up to
    ``rows`` rounded up to 128 (multiples of every block and RHT tile along the tokens)."""
    last = -(-rows // 128) * 128
    sizes, size = [], 128
    while size < last:
        sizes.append(size)
        size *= 2
    return (*sizes, last)


def _check(lhs, rhs, group_sizes, group_offset) -> None:
    """One line for a call ``jax.lax.ragged_dot`` would refuse, or that this one cannot run."""
    if group_offset is not None:
        raise ValueError("lp_jax.ragged_dot does not take group_offset (all groups are local)")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lp_jax.ragged_dot needs lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"lp_jax.ragged_dot needs integer group_sizes of shape ({rhs.shape[0]},) for "
                         f"{rhs.shape[0]} groups, got {group_sizes.dtype}{list(group_sizes.shape)}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lp_jax.ragged_dot needs floating inputs, got {lhs.dtype}")
    if isinstance(group_sizes, jax.core.Tracer):
        return  # known when it runs: rows past the last group come out zero, as in lax.ragged_dot
    sizes = np.asarray(group_sizes).tolist()  # a concrete array, also one a jitted function closes over
    if min(sizes) < 0 or sum(sizes) != lhs.shape[0]:
        raise ValueError(f"lp_jax.ragged_dot: group_sizes {sizes} must be non-negative and sum to the "
                         f"{lhs.shape[0]} rows of lhs")


def ragged_dot(recipe: Recipe | str, **overrides) -> LowPrecisionRaggedDot:
    """The quantized ``jax.lax.ragged_dot`` for ``recipe`` (a Recipe or a name for get_recipe)."""
    return LowPrecisionRaggedDot(dot_general(recipe, **overrides))
