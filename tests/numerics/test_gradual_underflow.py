"""lp_jax.numerics.gradual_underflow: float32 products and sums from integer operations,
bit for bit against numpy's IEEE arithmetic (which keeps subnormals, where XLA on CPU
flushes them), subnormal operands and results, ties, zeros, infinities and NaN included."""
import zlib

import jax
import numpy as np
import pytest

from lp_jax.numerics import gradual_underflow as G

N = 1 << 16
KINDS = ("any", "subnormal", "tiny", "near_one", "huge")
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -3.0, 1e-45, -2e-40, 3e38, -3e38,
                     2.0**-126, -(2.0**-126)], np.float32)


def _bits(rng, kind):
    sign = rng.integers(0, 2, N, dtype=np.uint32) << 31
    if kind == "any":
        return rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    if kind == "subnormal":
        return rng.integers(0, 0x800000, N, dtype=np.uint32) | sign
    if kind == "tiny":  # up to 2^-100: products and sums near and below the smallest normal
        return rng.integers(0, 0x0D800000, N, dtype=np.uint32) | sign
    if kind == "near_one":
        return rng.integers(0x3F000000, 0x40000000, N, dtype=np.uint32) | sign
    return rng.integers(0x7E000000, 0x7F800000, N, dtype=np.uint32) | sign  # "huge"


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


_OPS = {"mul": (jax.jit(G.mul), np.multiply), "add": (jax.jit(G.add), np.add),
        "sub": (jax.jit(G.sub), np.subtract)}


@pytest.mark.parametrize("op", list(_OPS))
def test_products_sums_and_differences_are_ieee(op):
    ours, numpy_op = _OPS[op]
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    for a_kind in KINDS:
        for b_kind in KINDS:
            a, b = _bits(rng, a_kind).view(np.float32), _bits(rng, b_kind).view(np.float32)
            with np.errstate(all="ignore"):
                want = numpy_op(a, b)
            ok = _same_bits(ours(a, b), want)
            assert ok.all(), (op, a_kind, b_kind, a[~ok][:3], b[~ok][:3], want[~ok][:3])


@pytest.mark.parametrize("op", list(_OPS))
def test_special_values(op):
    ours, numpy_op = _OPS[op]
    a, b = np.meshgrid(SPECIALS, SPECIALS)
    with np.errstate(all="ignore"):
        want = numpy_op(a, b)
    assert _same_bits(ours(a, b), want).all()


def test_ties_on_the_subnormal_grid_round_to_even():
    # 3 x 2^-150 and 5 x 2^-150 are ties between grid points; a sticky bit breaks the tie up
    a = np.array([3 * 2.0**-149, 5 * 2.0**-149, 3 * 2.0**-149, 2.0**-126, 1 + 2.0**-23], np.float32)
    b = np.array([0.5, 0.5, 0.5 + 2.0**-24, 1 - 2.0**-24, 2.0**-127], np.float32)
    assert _same_bits(jax.jit(G.ieee_mul)(a, b), a * b).all()
    # sums cancelling into the subnormal range are exact, and a tie of the normal grid rounds to even
    x = np.array([2.0**-126, 1.0, 1.0, -(2.0**-125)], np.float32)
    y = np.array([-(2.0**-126 - 2.0**-149), 2.0**-24, 3 * 2.0**-24, 2.0**-126 + 2.0**-149], np.float32)
    assert _same_bits(jax.jit(G.ieee_add)(x, y), x + y).all()


def test_the_comparison_sees_subnormals():
    a = np.array([1e-45, 2e-40, 0.0, 1.0, np.nan, 1.0], np.float32)
    b = np.array([3e-45, 1e-40, 1e-45, np.nan, 1.0, np.inf], np.float32)  # 1 and 2 x 2^-149 first
    np.testing.assert_array_equal(np.asarray(jax.jit(G.less_non_negative)(a, b)),
                                  [True, False, True, False, False, True])
