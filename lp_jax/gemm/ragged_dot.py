"""The quantized grouped GEMM of mixture-of-experts layers: ``jax.lax.ragged_dot`` in a recipe.

``lp.ragged_dot(recipe)(lhs[M, K], rhs[G, K, N], group_sizes[G])``: rows ``lhs`` sorted by
group, group ``g`` (``group_sizes[g]`` consecutive rows) multiplied by ``rhs[g]``. Each group
is quantized on its own, as Transformer Engine's GroupedLinear does: its output, dgrad and
wgrad are, bit for bit, what ``lp.dot_general(recipe)`` gives on that group's rows
zero-padded to M rows. Padding with zero rows changes no quantized value (a tensor amax, a
block amax and the RHT of a zero row are zero), so a block along the tokens (the wgrad
copies: 1x128, 1x32, 1x16 blocks, 16-row RHT tiles) starts at the group's first row and
never holds another expert's rows, and FP8-CS's and NVFP4's tensor scales are the group's
own. Against ``lp.dot_general`` on the group's rows alone, without stochastic rounding, the
output and dgrad are the same bits; the wgrad, a sum over the group's rows, may differ in
the order XLA:CPU adds its FP32 partial sums over M rows rather than the group's (the quantized
values are the same). With stochastic rounding, group ``g`` draws the bits
``lp.dot_general`` draws on its padded rows under the key ``fold_in(k, g)``, where ``k`` is
the grouped call's own site key (``lp_jax.context``): every group's bits differ, and a
resumed run draws the same ones.

The emulation (any platform) runs one window of M rows per group, in a ``lax.scan``: G
times the GEMM work of one dense GEMM of M rows, and G windows of quantized residuals.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax import context
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.recipes import Recipe, get_recipe

_LINEAR = (((1,), (0,)), ((), ()))


def _stochastic(recipe: Recipe) -> bool:
    return any(spec.stochastic for spec in recipe.operand_specs())


@dataclasses.dataclass(frozen=True)
class LowPrecisionRaggedDot:
    """A ``jax.lax.ragged_dot`` that runs each group's GEMMs through ``dot_general`` (an
    ``lp.dot_general`` or a layer-policy one: it is called once per group, inside the
    layer scope of the caller, so FiLj applies to experts as to Linears)."""

    dot_general: object

    @property
    def recipe(self) -> Recipe:
        return self.dot_general.recipe

    def __call__(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                 group_offset=None):
        _check(lhs, rhs, group_sizes, group_offset)
        m, k = lhs.shape
        out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
        sizes = group_sizes.astype(jnp.int32)
        starts = jnp.cumsum(sizes) - sizes
        # Windows start at a group's first row and run M rows: the padding keeps every
        # dynamic slice in bounds (a clamped slice would shift its rows).
        x_pad = jnp.concatenate([lhs, jnp.zeros((m, k), lhs.dtype)])
        key = context.site_key() if _stochastic(self.recipe) else None
        rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)

        def group(out, xs):
            g, w_g, start, size = xs
            in_group = rows < size
            x_g = jnp.where(in_group, lax.dynamic_slice_in_dim(x_pad, start, m), 0)
            scope = (context.rng_scope(jax.random.fold_in(key, g)) if key is not None
                     else contextlib.nullcontext())
            with scope:
                y_g = self.dot_general(x_g, w_g, _LINEAR, preferred_element_type=out_dtype)
            kept = lax.dynamic_slice_in_dim(out, start, m)
            out = lax.dynamic_update_slice_in_dim(out, jnp.where(in_group, y_g.astype(out_dtype), kept), start, 0)
            return out, None

        out = jnp.zeros((2 * m, rhs.shape[2]), out_dtype)
        groups = jnp.arange(rhs.shape[0], dtype=jnp.uint32)
        out, _ = lax.scan(group, out, (groups, rhs, starts, sizes))
        return out[:m]


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
    sizes = [int(s) for s in group_sizes]
    if min(sizes) < 0 or sum(sizes) != lhs.shape[0]:
        raise ValueError(f"lp_jax.ragged_dot: group_sizes {sizes} must be non-negative and sum to the "
                         f"{lhs.shape[0]} rows of lhs")


def ragged_dot(recipe: Recipe | str, **overrides) -> LowPrecisionRaggedDot:
    """The quantized ``jax.lax.ragged_dot`` for ``recipe`` (a Recipe or a name for get_recipe)."""
    if isinstance(recipe, str) or overrides:
        recipe = get_recipe(recipe, **overrides)
    return LowPrecisionRaggedDot(LowPrecisionDotGeneral(recipe))
