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
per group would be G times. Each window's output is written into one buffer, group after
group. A custom VJP gives the backward the same shape: per group, the VJP of its window's
``dot_general`` call (dot_general's own dgrad and wgrad) on its rows of x and dy, its dgrad
written into one buffer. Differentiating the switch instead kept every branch's residuals
(zeros from the branches not taken) and a cotangent of the whole buffer per group: 2-4x the
time of a loop of dense GEMMs. The group's GEMM is traced once per window length when the
grouped call is traced, inside its contexts (layer scope, SR key, a layer policy's choice);
the backward replays that trace, so it draws the forward's bits though it is traced later.
It keeps x (not its quantized copies) and quantizes each window again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from lp_jax import context
from lp_jax.gemm.dot_general import _needs_key, dot_general
from lp_jax.recipes import Recipe

_LINEAR = (((1,), (0,)), ((), ()))
# Up to this many groups run unrolled, each group's GEMMs their own instructions in the
# compiled program (what the plan's GEMM counts read); more are scanned. On XLA:CPU a scan
# over 8 groups (4096 rows, sizes traced) runs as fast and compiles 2.5x faster.
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
    # rank's experts (expert parallelism, models.moe_dispatch), for the groups' SR keys; and
    # ``expected_rows``: what group_sizes sum to under even routing when lhs is a worst-case
    # buffer, for the plan's cost of each group's window.
    takes_first_group = True

    @property
    def recipe(self) -> Recipe:
        return self.dot_general.recipe

    def __call__(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                 group_offset=None, first_group=0, expected_rows=None):
        _check(lhs, rhs, group_sizes, group_offset)
        out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
        key = context.site_key() if _needs_key(self.recipe) else None

        def group_gemm(x_g, w_g, g):
            scope = (context.rng_scope(jax.random.fold_in(key, g)) if key is not None
                     else contextlib.nullcontext())
            with scope:
                return self.dot_general(x_g, w_g, _LINEAR, preferred_element_type=out_dtype)

        w_aval = jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype)
        gemms = tuple(
            _WindowGemm.trace(group_gemm, jax.ShapeDtypeStruct((rows, lhs.shape[1]), lhs.dtype), w_aval)
            for rows in window_sizes(lhs.shape[0]))
        # The window a group of an even share of the routed rows takes: the branch the plan
        # costs (lp_jax.plan.hlo_module). An expert-parallel rank's lhs is a worst-case buffer
        # that routing fills to expected_rows.
        even_share = -(-(lhs.shape[0] if expected_rows is None else expected_rows) // rhs.shape[0])
        expected = int(np.searchsorted([g.rows for g in gemms], even_share))
        # first_group: the global index of rhs's first expert (an expert-parallel rank holds a
        # slice), which keys its stochastic rounding as on one device.
        return _grouped(gemms, expected, lhs, rhs, group_sizes.astype(jnp.int32),
                        jnp.asarray(first_group, jnp.uint32), tuple(g.traced for g in gemms))


@dataclasses.dataclass(frozen=True, eq=False)
class _WindowGemm:
    """One group's GEMM ``(x_g [rows, K], w_g, g) -> y_g`` on a window of ``rows`` rows,
    traced once, under the contexts the grouped call is traced in (its layer scope, its
    stochastic rounding key, a layer policy's choice): the backward, traced later outside
    them, replays this jaxpr. ``traced`` are the traced values it closes over (the SR key,
    a traced layer index), which the grouped call passes on as its own inputs."""

    rows: int
    closed: jax_core.ClosedJaxpr
    traced_at: tuple[int, ...]  # positions of the traced values among the jaxpr's consts

    @classmethod
    def trace(cls, fn, x_aval, w_aval):
        closed = jax.make_jaxpr(fn)(x_aval, w_aval, jax.ShapeDtypeStruct((), jnp.uint32))
        traced_at = tuple(i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer))
        return cls(x_aval.shape[0], closed, traced_at)

    @property
    def traced(self) -> tuple:
        return tuple(self.closed.consts[i] for i in self.traced_at)

    def __call__(self, traced, x_g, w_g, g):
        consts = list(self.closed.consts)
        for i, value in zip(self.traced_at, traced):
            consts[i] = value
        return jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(self.closed.jaxpr, consts))(x_g, w_g, g)[0]


def _rows(t, start, size, rows):
    """The group's rows of ``t`` (``size`` rows from ``start``) at the top of a window of
    ``rows`` rows, the rest zero, written out once: fused into its consumers, XLA:CPU would
    slice and mask per read (the NVFP4 wgrad RHT reads each element 16 times: 1.7x the step
    of the same windows without it). Only the window is read: a window that would reach
    past ``t`` is read from ``rows`` rows that end at its end and rolled up (no padded copy
    of ``t``)."""
    t = _padded(t, rows - t.shape[0]) if rows > t.shape[0] else t  # the largest window only
    at = jnp.minimum(start, t.shape[0] - rows)
    window = jnp.roll(lax.dynamic_slice_in_dim(t, at, rows), at - start, axis=0)
    in_group = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < size
    return lax.optimization_barrier(jnp.where(in_group, window, 0))


def _placed(out, y_g, start, size):
    """``out`` with its rows ``start .. start + size`` replaced by the first ``size`` rows of
    the window ``y_g``, every other row as it was (rows past the groups stay zero, so a
    non-finite weight times the window's zero rows lands nowhere). Writes the window's
    length in place, placed as ``_rows`` reads it."""
    rows, m = y_g.shape[0], out.shape[0]
    if rows > m:  # the largest window, longer than out (M not a multiple of 128)
        row = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
        return jnp.where((row >= start) & (row < start + size), jnp.roll(y_g, start, axis=0)[:m], out)
    at = jnp.minimum(start, m - rows)
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) + at
    update = jnp.where((row >= start) & (row < start + size), jnp.roll(y_g, start - at, axis=0),
                       lax.dynamic_slice_in_dim(out, at, rows))
    return lax.dynamic_update_slice_in_dim(out, update, at, 0)


def _padded(t, rows):
    """``t`` with ``rows`` zero rows after it."""
    return jnp.concatenate([t, jnp.zeros((rows,) + t.shape[1:], t.dtype)])


def _over_groups(step, carry, xs):
    """``lax.scan(step, carry, xs)``, unrolled up to UNROLLED_GROUPS groups."""
    groups = len(xs[0])
    if groups > UNROLLED_GROUPS:
        return lax.scan(step, carry, xs)
    ys = []
    for g in range(groups):
        carry, y = step(carry, tuple(x[g] for x in xs))
        ys.append(y)
    return carry, (None if ys[0] is None else jnp.stack(ys))


def _switch(gemms, expected, size, branch, *operands):
    """``branch(gemm)`` of the smallest window that holds the group's ``size`` rows: only
    that one runs. Traced under ``lp_expected_branch_<expected>``, the window of a group
    holding an even share of the routed rows, which ``python -m lp_jax.plan`` then counts
    alone (its cost under balanced routing; lp_jax.plan.hlo_module)."""
    # searchsorted's index without its while loop
    which = jnp.sum(size > jnp.asarray([gemm.rows for gemm in gemms]))
    with jax.named_scope(f"lp_expected_branch_{expected}"):
        return lax.switch(which, [branch(gemm, i) for i, gemm in enumerate(gemms)], *operands)


# Each group's window output is written over the buffer's rows of the group alone (the
# window's other rows are the products of zero rows), so rows past the groups stay zero.
# The backward writes dgrad windows the same way. No operand is padded: a window near the
# end of a buffer is read and written at the buffer's end (``_rows``, ``_placed``).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(gemms, expected, x, w, sizes, first, traced):
    starts = jnp.cumsum(sizes) - sizes

    def branch(gemm, i):
        def run(out, g, w_g, start, size):
            y_g = gemm(traced[i], _rows(x, start, size, gemm.rows), w_g, g)
            return _placed(out, y_g, start, size)
        return run

    def group(out, xs):
        g, w_g, start, size = xs
        return _switch(gemms, expected, size, branch, out, g, w_g, start, size), None

    y_aval = gemms[0].closed.out_avals[0]
    out = jnp.zeros((x.shape[0], y_aval.shape[1]), y_aval.dtype)
    groups = jnp.arange(w.shape[0], dtype=jnp.uint32) + first
    return _over_groups(group, out, (groups, w, starts, sizes))[0]


def _grouped_fwd(gemms, expected, x, w, sizes, first, traced):
    # The inputs are the residuals: the backward quantizes each group's window again.
    return _grouped(gemms, expected, x, w, sizes, first, traced), (x, w, sizes, first, traced)


def _grouped_bwd(gemms, expected, res, dy):
    """Each group's dgrad and wgrad: the VJP of its window's GEMM (dot_general's own), run
    in that window only, so no cotangent of the whole buffer arises per group."""
    x, w, sizes, first, traced = res
    starts = jnp.cumsum(sizes) - sizes
    # Traced floating values a GEMM closes over get their cotangents (e.g. statistics taps).
    inexact = [[j for j, t in enumerate(ts) if jnp.issubdtype(t.dtype, jnp.inexact)] for ts in traced]

    def branch(gemm, i):
        def run(carry, g, w_g, start, size):
            dx, d_traced = carry

            def window_gemm(x_g, w_g, floats):
                ts = list(traced[i])
                for j, t in zip(inexact[i], floats):
                    ts[j] = t
                return gemm(ts, x_g, w_g, g)

            _, vjp = jax.vjp(window_gemm, _rows(x, start, size, gemm.rows), w_g,
                             [traced[i][j] for j in inexact[i]])
            dx_g, dw_g, d_floats = vjp(_rows(dy, start, size, gemm.rows))
            d_traced = [[a + b for a, b in zip(ds, d_floats)] if k == i else ds
                        for k, ds in enumerate(d_traced)]
            return (_placed(dx, dx_g, start, size), d_traced), dw_g
        return run

    def group(carry, xs):
        g, w_g, start, size = xs
        return _switch(gemms, expected, size, branch, carry, g, w_g, start, size)

    d_floats = [[jnp.zeros_like(traced[i][j]) for j in js] for i, js in enumerate(inexact)]
    groups = jnp.arange(w.shape[0], dtype=jnp.uint32) + first
    (dx, d_floats), dw = _over_groups(group, (jnp.zeros(x.shape, x.dtype), d_floats),
                                      (groups, w, starts, sizes))
    d_traced = tuple(tuple(d_floats[i][js.index(j)] if j in js else None for j in range(len(ts)))
                     for i, (ts, js) in enumerate(zip(traced, inexact)))
    return dx, dw, None, None, d_traced


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


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
