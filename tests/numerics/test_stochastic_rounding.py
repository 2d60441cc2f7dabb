"""NVFP4 stochastic rounding (docs/numerics.md, "Stochastic rounding").

For v between adjacent E2M1 values lo <= |v| <= hi, |v| rounds up with probability
(|v| - lo) / (hi - lo); nothing exceeds 6; the sign is kept; block scales always round to
nearest. v = clip(t * enc_b, -6, 6) comes from the oracle (RefQuantized.scaled).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from tests.support import numpy_reference as ref
from tests.support import quantize_checks as qc
from tests.support.numpy_reference_casts import E2M1, decode

N_KEYS = 256
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # E2M1 magnitudes


def _neighbours(v):
    """(lo, hi): the adjacent E2M1 magnitudes around |v| (equal when |v| is on the grid)."""
    a = np.abs(v)
    lo = GRID[np.searchsorted(GRID, a, side="right") - 1]
    hi = GRID[np.minimum(np.searchsorted(GRID, a, side="left"), len(GRID) - 1)]
    return lo, hi


def _input():
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    x[0, :5] = 0  # zeros stay zero
    x[1, :16] = [3, 1, 2, 0.5, 1.5, -3, -1, 0.25, 0.75, -0.25, 0, 0, 0, 0, 0, 0]  # on or near the grid
    return x


@pytest.fixture(scope="module")
def draws():
    """(x, oracle, [QuantizedTensor for each of N_KEYS keys]) with a jitted SR quantizer."""
    x = _input()
    sr = jax.jit(lambda a, k: lp.quantize(a, "nvfp4", rounding="stochastic", key=k))
    qs = [sr(jnp.asarray(x), jax.random.key(k)) for k in range(N_KEYS)]
    return x, ref.quantize(x, "nvfp4"), qs


def test_scales_are_the_nearest_rounding_scales(draws):
    x, r, qs = draws
    for q in qs[:8]:
        qc.check_quantized(lp, q, x, "nvfp4", check_data=False)  # s_b and S_dec bit for bit


def test_every_draw_is_one_of_the_two_neighbours(draws):
    x, r, qs = draws
    values = np.stack([decode(qc.codes(q.data), E2M1) for q in qs])  # (keys, 8, 64)
    lo, hi = _neighbours(r.scaled)
    mag = np.abs(values)
    assert ((mag == lo) | (mag == hi)).all()
    assert (np.signbit(values) == np.signbit(r.scaled))[values != 0].all()  # the sign is kept
    assert (values[:, lo == hi] == r.scaled[lo == hi]).all()  # values on the grid never move


def test_rounds_up_with_the_stated_probability(draws):
    x, r, qs = draws
    lo, hi = _neighbours(r.scaled)
    between = hi > lo
    up = np.stack([np.abs(decode(qc.codes(q.data), E2M1)) == hi for q in qs]).mean(axis=0)
    p = (np.abs(r.scaled) - lo) / np.where(between, hi - lo, 1)
    sigma = np.sqrt(p * (1 - p) / N_KEYS)
    excess = (np.abs(up - p) - (6 * sigma + 2 / N_KEYS))[between]
    assert excess.max() <= 0, f"up-rate off by {excess.max():.3f} beyond 6 sigma"
    assert abs((up - p)[between].mean()) < 0.01  # no bias on average either


def test_mean_over_keys_is_closer_to_the_input_than_nearest(draws):
    x, r, qs = draws
    mean = np.mean([np.asarray(lp.dequantize(q)) for q in qs], axis=0)
    sr_error, nearest_error = np.abs(mean - x).sum(), np.abs(r.dequantized - x).sum()
    assert sr_error < 0.5 * nearest_error, (sr_error, nearest_error)


def test_same_key_same_bits_other_key_other_bits(draws):
    x, r, qs = draws
    again = lp.quantize(jnp.asarray(x), "nvfp4", rounding="stochastic", key=jax.random.key(0))  # eager
    np.testing.assert_array_equal(qc.codes(again.data), qc.codes(qs[0].data))
    assert (qc.codes(qs[0].data) != qc.codes(qs[1].data)).any()


def test_stochastic_along_a_non_last_axis():
    x = np.random.default_rng(1).standard_normal((40, 6)).astype(np.float32)
    r = ref.quantize(x, "nvfp4", axis=0)
    lo, hi = _neighbours(r.scaled)
    sr = jax.jit(lambda a, k: lp.quantize(a, "nvfp4", axis=0, rounding="stochastic", key=k))
    for k in range(3):
        q = sr(jnp.asarray(x), jax.random.key(k))
        qc.check_quantized(lp, q, x, "nvfp4", axis=0, check_data=False)
        mag = np.abs(decode(qc.codes(q.data), E2M1))
        assert ((mag == lo) | (mag == hi)).all()
