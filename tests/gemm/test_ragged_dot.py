"""lp.ragged_dot: each group of the grouped GEMM is lp.dot_general on that group's rows.

Forward, dgrad and wgrad, bit for bit, in every recipe, against lp.dot_general on the
group's rows zero-padded to its window (with SR under the key fold_in(k, g)); without SR,
against the group's rows alone (the module docstring says how exactly). Group sizes include
0 and sizes that are not a multiple of any block (so a 1x128 block or a 16-row RHT tile
would straddle experts if the grid were the whole tensor's)."""
import contextlib
import contextvars
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax import context
from lp_jax.gemm import ragged_dot
from lp_jax.gemm.ragged_dot import LowPrecisionRaggedDot, window_sizes
from models.layer_scope import layer_scope

M, K, N = 200, 256, 96
SIZES = (37, 0, 140, 23)  # windows of 128 and 256 rows
LINEAR = (((1,), (0,)), ((), ()))
RECIPES = {"bf16": {}, "fp8_cs": {}, "fp8_block": {}, "mxfp8": {},
           "nvfp4": dict(disable_stochastic_rounding=True), "nvfp4_sr": {}}


def _operands(seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    # Each expert's weights on another scale, so a shared tensor scale would show.
    w = jax.random.normal(kw, (len(SIZES), K, N), jnp.float32) * jnp.array([0.02, 1.0, 0.3, 5.0])[:, None, None]
    dy = jax.random.normal(kd, (M, N), jnp.float32).astype(jnp.bfloat16)
    return x, w, dy


def _recipe(name):
    return lp.get_recipe(name.removesuffix("_sr"), **RECIPES[name])


def _grouped(recipe, x, w, dy, sizes, seed=3):
    rd = lp.ragged_dot(recipe)

    def f(x, w):
        with context.rng_scope(jax.random.key(seed)):
            return rd(x, w, jnp.asarray(sizes, jnp.int32))

    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)


def _dense(recipe, x, w, dy, key=None):
    dg = lp.dot_general(recipe)

    def f(x, w):
        if key is None:
            return dg(x, w, LINEAR)
        with context.rng_scope(key):
            return dg(x, w, LINEAR)

    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)


def _window(size):
    return next(w for w in window_sizes(M) if w >= size)


def _padded(t, start, size, rows=None):
    """The group's rows of t, zero-padded to its window: what the grouped GEMM runs."""
    rows = rows or _window(size)
    return jnp.zeros((rows,) + t.shape[1:], t.dtype).at[:size].set(t[start:start + size])


def _starts():
    return np.concatenate([[0], np.cumsum(SIZES)[:-1]])


def _some_slow(names, fast):
    """The cases the fast suite runs; CI runs the rest with -m slow."""
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _some_slow(RECIPES, fast=("fp8_cs",)))
def test_each_group_is_dot_general_on_its_padded_rows_bit_for_bit(name):
    """Forward, dgrad and wgrad; with SR under the key fold_in(k, g) of the call's key k."""
    x, w, dy = _operands()
    recipe = _recipe(name)
    y, dx, dw = jax.jit(lambda x, w, dy: _grouped(recipe, x, w, dy, SIZES, seed=5))(x, w, dy)
    with context.rng_scope(jax.random.key(5)):
        call_key = context.site_key()  # the grouped call is the scope's first site
    dense = jax.jit(lambda x, w, dy, k: _dense(recipe, x, w, dy, k))
    for g, (start, size) in enumerate(zip(_starts(), SIZES)):
        ry, rdx, rdw = dense(_padded(x, start, size), w[g], _padded(dy, start, size),
                             jax.random.fold_in(call_key, g))
        rows = slice(start, start + size)
        np.testing.assert_array_equal(np.asarray(y[rows], np.float32), np.asarray(ry[:size], np.float32))
        np.testing.assert_array_equal(np.asarray(dx[rows], np.float32), np.asarray(rdx[:size], np.float32))
        np.testing.assert_array_equal(np.asarray(dw[g]), np.asarray(rdw))
        if size == 0:
            assert not np.any(np.asarray(dw[g])), "an expert with no rows gets a zero gradient"
    assert dw.dtype == jnp.float32 and y.dtype == jnp.bfloat16
    if recipe.name == "nvfp4" and not recipe.disable_stochastic_rounding:
        # The bits differ per group: group 2's rows under group 0's key round otherwise.
        other = dense(_padded(x, _starts()[2], SIZES[2]), w[2], _padded(dy, _starts()[2], SIZES[2]),
                      jax.random.fold_in(call_key, 0))[2]
        assert np.any(np.asarray(other) != np.asarray(dw[2]))


@pytest.mark.parametrize("fmt, axis, rht", [
    ("fp8_e4m3", 0, False), ("fp8_block", 0, False),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("nvfp4", 0, True), ("fp8_block", 1, False), ("mxfp8", 0, False), ("mxfp8", 1, False), ("nvfp4", 0, False),
        ("nvfp4", 1, False)])])
def test_padding_a_groups_rows_changes_no_quantized_value(fmt, axis, rht):
    """Why the window is the group's own: a group of 63 rows padded with zeros to 200 rows
    quantizes to the same values (tensor scales, blocks along the rows starting at its first
    row, 16-row RHT tiles), so no block holds two experts' rows."""
    x = _operands()[0][:, :96] * 7.0
    alone, padded = x[37:100], _padded(x, 37, 63, rows=M)

    def values(t):
        if rht:
            t = lp.hadamard(jnp.pad(t, ((0, -t.shape[0] % 16), (0, 0))), axis=0)
        return np.asarray(lp.dequantize(lp.quantize(t, fmt, axis=axis)))[:63]

    np.testing.assert_array_equal(values(padded), values(alone))
    assert not np.array_equal(values(alone), values(x)[37:100]), "the whole tensor's grid would differ"


@pytest.mark.parametrize("name", _some_slow([n for n in RECIPES if n != "nvfp4_sr"], fast=("bf16",)))
def test_without_sr_each_group_is_dot_general_on_its_rows_alone(name):
    """Outputs and dgrad bit for bit; the wgrad, which sums over the group's rows, up to the
    order of XLA:CPU's FP32 sums (a GEMM over 63 rows and one over 200 rows, 137 of them zero,
    may add in another order)."""
    x, w, dy = _operands()
    recipe = _recipe(name)
    y, dx, dw = jax.jit(lambda x, w, dy: _grouped(recipe, x, w, dy, SIZES))(x, w, dy)
    dense = jax.jit(lambda x, w, dy: _dense(recipe, x, w, dy))
    for g, (start, size) in enumerate(zip(_starts(), SIZES)):
        if size == 0:
            continue
        rows = slice(start, start + size)
        ry, rdx, rdw = dense(x[rows], w[g], dy[rows])
        np.testing.assert_array_equal(np.asarray(y[rows], np.float32), np.asarray(ry, np.float32))
        np.testing.assert_array_equal(np.asarray(dx[rows], np.float32), np.asarray(rdx, np.float32))
        np.testing.assert_allclose(np.asarray(dw[g]), np.asarray(rdw), rtol=1e-6, atol=1e-6 * float(np.abs(rdw).max()))


@pytest.mark.parametrize("name", _some_slow(["bf16", "nvfp4_sr"], fast=("bf16",)))
def test_groups_past_the_unrolled_count_run_in_a_scan_to_the_same_bits(name, monkeypatch):
    """Over UNROLLED_GROUPS groups, forward and backward scan over them (the group index, and
    with it each group's SR key, traced): the same bits as unrolled."""
    x, w, dy = _operands()
    recipe = _recipe(name)
    unrolled = jax.jit(lambda x, w, dy: _grouped(recipe, x, w, dy, SIZES))(x, w, dy)
    monkeypatch.setattr(ragged_dot, "UNROLLED_GROUPS", 2)
    scanned = jax.jit(lambda x, w, dy: _grouped(recipe, x, w, dy, SIZES))(x, w, dy)
    for a, b in zip(unrolled, scanned):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow
def test_the_backward_draws_the_bits_of_the_forwards_layer_scope():
    """The backward, traced after the layer scope closed, still quantizes each group's dy
    with the bits lp.dot_general draws inside it (the layer index is part of the key)."""
    x, w, dy = _operands()
    recipe = _recipe("nvfp4_sr")

    def grads(layer):
        with layer_scope(layer) if layer is not None else contextlib.nullcontext():
            return jax.jit(lambda x, w, dy: _grouped(recipe, x, w, dy, SIZES, seed=5))(x, w, dy)

    _, dx, dw = grads(3)
    with context.rng_scope(jax.random.key(5)), layer_scope(3):
        call_key = context.site_key()
    start, size = _starts()[2], SIZES[2]
    with layer_scope(3):
        ref = _dense(recipe, _padded(x, start, size), w[2], _padded(dy, start, size),
                     jax.random.fold_in(call_key, 2))
    np.testing.assert_array_equal(np.asarray(dx[start:start + size], np.float32),
                                  np.asarray(ref[1][:size], np.float32))
    np.testing.assert_array_equal(np.asarray(dw[2]), np.asarray(ref[2]))
    assert np.any(np.asarray(grads(None)[2][2]) != np.asarray(dw[2])), "the layer index changes the bits"


def test_rows_past_the_groups_are_zero_even_with_a_non_finite_weight():
    """Traced group sizes may sum to less than M (as lax.ragged_dot allows): the windows
    reaching past the groups leave nothing there, in y or in dx."""
    x, w, dy = _operands()
    w = w.at[3, 5, 7].set(jnp.inf)
    y, dx, dw = jax.jit(lambda x, w, dy, sizes: _grouped(lp.get_recipe("bf16"), x, w, dy, sizes))(
        x, w, dy, jnp.asarray((37, 0, 100, 23), jnp.int32))
    assert not np.any(np.asarray(y[160:], np.float32)) and not np.any(np.asarray(dx[160:], np.float32))
    # The last group's window (zero rows times inf: NaN) covers the rows past the groups.
    assert not np.all(np.isfinite(np.asarray(y[137:160], np.float32)))


_SCALE = contextvars.ContextVar("test_ragged_dot_scale")


@dataclasses.dataclass(frozen=True)
class _ScaledDotGeneral:
    """lp.dot_general times a traced scale it reads while traced, as a statistics tap
    closes over its sink: the scale's gradient must come back through the grouped call."""

    inner: lp.LowPrecisionDotGeneral

    @property
    def recipe(self):
        return self.inner.recipe

    def __call__(self, lhs, rhs, dimension_numbers, preferred_element_type=None):
        y = self.inner(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
        return y * _SCALE.get().astype(y.dtype)


def test_a_traced_value_the_gemm_closes_over_gets_its_gradient():
    x, w, dy = _operands()
    grouped = LowPrecisionRaggedDot(_ScaledDotGeneral(lp.dot_general("bf16")))
    sizes = jnp.asarray(SIZES, jnp.int32)

    def loss(scale, x):
        token = _SCALE.set(scale)
        try:
            y = grouped(x, w, sizes, preferred_element_type=jnp.float32)
        finally:
            _SCALE.reset(token)
        return jnp.vdot(y, dy.astype(jnp.float32))

    d_scale, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.float32(2.0), x)
    unscaled = lp.ragged_dot("bf16")(x, w, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(float(d_scale), float(jnp.vdot(unscaled, dy.astype(jnp.float32))), rtol=1e-5)
    _, ref_dx, _ = _grouped(lp.get_recipe("bf16"), x, w, dy, SIZES)
    np.testing.assert_allclose(np.asarray(dx, np.float32), 2 * np.asarray(ref_dx, np.float32), rtol=1e-2)


def test_bf16_matches_lax_ragged_dot_to_rounding():
    x, w, _ = _operands()
    sizes = jnp.asarray(SIZES, jnp.int32)
    ours = lp.ragged_dot("bf16")(x, w, sizes, preferred_element_type=jnp.float32)
    ref = jax.lax.ragged_dot(x, w.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("args, message", [
    (dict(sizes=(37, 0, 100, 60)), "sum to the 200 rows"),
    (dict(sizes=(37, 0, 100)), r"group_sizes of shape \(4,\)"),
    (dict(sizes=(237, -37, 0, 0)), "non-negative"),
    (dict(w_shape=(4, 128, N)), r"lhs \[M, K\] and rhs \[G, K, N\]"),
    (dict(offset=True), "group_offset"),
])
def test_bad_calls_raise_one_line(args, message):
    x, w, _ = _operands()
    w = jnp.zeros(args.get("w_shape", w.shape), w.dtype)
    sizes = jnp.asarray(args.get("sizes", SIZES), jnp.int32)
    with pytest.raises(ValueError, match=message) as e:
        lp.ragged_dot("mxfp8")(x, w, sizes, group_offset=jnp.zeros(1, jnp.int32) if args.get("offset") else None)
    assert "\n" not in str(e.value)


def test_windows_are_multiples_of_128_up_to_the_rows():
    assert window_sizes(200) == (128, 256)
    assert window_sizes(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert window_sizes(1000) == (128, 256, 512, 1024)
    assert window_sizes(100) == (128,)


@pytest.mark.parametrize("expected_rows, branch", [(None, 2), (256, 0), (1024, 1)])
def test_the_plans_expected_branch_is_the_window_of_an_even_share_of_the_routed_rows(expected_rows, branch):
    # 2048 rows in 4 groups: windows 128, 256, 512, 1024, 2048. An even share of all of them
    # is 512 (branch 2); of a worst-case buffer that routing fills to 256 rows, 64 (branch 0).
    grouped = lp.ragged_dot(lp.get_recipe("mxfp8"))
    x, w = jnp.zeros((2048, 64), jnp.bfloat16), jnp.zeros((4, 64, 32), jnp.float32)
    step = jax.jit(jax.grad(lambda x, w: jnp.sum(grouped(x, w, jnp.array([512] * 4), expected_rows=expected_rows)),
                            argnums=(0, 1)))
    # The lowered program's locations (a compiled one may come from the tests' persistent
    # cache, whose key leaves names out: another case's names).
    text = step.lower(x, w).as_text(debug_info=True)
    scopes = {int(s) for s in re.findall(r"lp_expected_branch_(\d+)", text)}
    assert scopes == {branch}, scopes
