"""models.row_permutation.gather_rows: the expert-parallel dispatch's permutations, whose
backward gathers with the inverse map instead of scatter-adding over the whole buffer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.row_permutation import gather_rows


def _maps(rows_in: int, rows_out: int, seed: int):
    """(index [rows_out], inverse [rows_in]): rows_out slots, some naming distinct rows of
    the input, the rest out of range; the input rows no slot names get an out-of-range
    inverse."""
    rng = np.random.default_rng(seed)
    taken = rng.permutation(rows_in)[: min(rows_in, rows_out) - 3]
    index = np.full(rows_out, rows_in, np.int32)
    slots = rng.permutation(rows_out)[: len(taken)]
    index[slots] = taken
    inverse = np.full(rows_in, rows_out + 5, np.int32)
    inverse[taken] = slots
    return jnp.asarray(index), jnp.asarray(inverse)


def _plain(x, index):
    """The same gather, differentiated by autodiff (its transpose a scatter-add)."""
    valid = (index < x.shape[0])[:, None]
    return jnp.where(valid, x[jnp.minimum(index, x.shape[0] - 1)], 0).astype(x.dtype)


@pytest.mark.parametrize("rows_in, rows_out", [(40, 64), (64, 40)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gather_and_its_gradient_are_autodiffs_values(rows_in, rows_out, dtype):
    index, inverse = _maps(rows_in, rows_out, seed=rows_in)
    x = jax.random.normal(jax.random.key(0), (rows_in, 24), dtype)
    dy = jax.random.normal(jax.random.key(1), (rows_out, 24), dtype)
    y, vjp = jax.vjp(lambda x: gather_rows(x, index, inverse), x)
    y_ref, vjp_ref = jax.vjp(lambda x: _plain(x, index), x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    (dx,), (dx_ref,) = vjp(dy), vjp_ref(dy)
    assert dx.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))
    # Rows no slot names get no gradient.
    unnamed = np.setdiff1d(np.arange(rows_in), np.asarray(index))
    assert len(unnamed) and not np.any(np.asarray(dx, np.float32)[unnamed])


def test_the_backward_gathers_instead_of_scattering():
    index, inverse = _maps(40, 64, seed=0)
    x = jnp.ones((40, 8), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(gather_rows(x, index, inverse) ** 2))
    text = str(jax.make_jaxpr(grad)(x))
    assert "scatter" not in text and "gather" in text
    assert "scatter-add" in str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(_plain(x, index) ** 2)))(x))
