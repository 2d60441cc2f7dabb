"""lp_jax.numerics.formats: the bit-level helpers, checked against exact rational arithmetic."""
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.numerics import formats as F


def test_rceil_code0_threshold_is_exact():
    """RCEIL_CODE0_MAX_AMAX is the largest float32 amax whose d = amax*fp32(1/448),
    rounded to nearest-even on the subnormal grid (spacing 2^-149), is <= 2^-127."""
    c = Fraction(float(F.INV_E4M3_MAX))
    limit = Fraction(1, 2**127) + Fraction(1, 2**150)  # midpoint; its tie rounds to even 0x400000
    t = F.RCEIL_CODE0_MAX_AMAX
    above = np.nextafter(t, np.float32(1))
    assert Fraction(float(t)) * c <= limit < Fraction(float(above)) * c


@pytest.mark.parametrize("k", [-126, -1, 0, 1, 127])
def test_exp2_int(k):
    assert float(F.exp2_int(k)) == 2.0**k


@pytest.mark.parametrize("k,x_exp", [(-127, 120), (-200, 100), (127, -120), (200, -100), (0, 3)])
def test_mul_exp2_is_exact_where_a_single_factor_would_be_subnormal(k, x_exp):
    # 2^-127 alone is a float32 subnormal, flushed to zero by XLA on CPU.
    got = F.mul_exp2(jnp.float32(1.5 * 2.0**x_exp), k)
    assert float(got) == 1.5 * 2.0 ** (x_exp + k)


@pytest.mark.parametrize("k,x_exp", [(-140, 100), (-200, 100), (-250, 126), (200, -100), (127, -120)])
def test_mul_exp2_is_exact_under_jit_with_a_constant_k(k, x_exp):
    # A constant k makes both factors constants; XLA before 0.12 (JAX 0.11) folded them
    # into one 2^k (subnormal: flushed to zero; above 2^127: inf).
    got = jax.jit(lambda x: F.mul_exp2(x, k))(jnp.float32(1.5 * 2.0**x_exp))
    assert float(got) == 1.5 * 2.0 ** (x_exp + k)


def _ieee_products(x, s):
    """float32 x * s rounded once (the float64 product of two float32 is exact), and
    where that result is a float32 subnormal (XLA on CPU may flush those)."""
    want = (x.astype(np.float64) * s.astype(np.float64)).astype(np.float32)
    return want, (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_mul_by_a_subnormal_scale_is_the_ieee_product(mode):
    # Every subnormal scale s = m * 2^-149 a tensor factor can take (1/S_enc, 1/FLT_MAX),
    # times x across the float32 range, including x * m beyond FLT_MAX (a finite product).
    # Under jit on JAX 0.11 the former two power-of-two steps folded into a flushed 2^-149.
    rng = np.random.default_rng(0)
    s = np.concatenate([[1, 0x400000, 0x200000, 0x7FFFFF], rng.integers(1, 0x800000, 60)]).astype(np.uint32).view(np.float32)
    x = (rng.uniform(1, 2, (64, 128)) * np.exp2(rng.integers(-30, 128, (64, 128)))).astype(np.float32)
    x *= rng.choice([np.float32(-1), np.float32(1)], x.shape)
    x[:, :4] = [0.0, -0.0, np.inf, np.nan]
    fn = jax.vmap(F.mul)
    got = np.asarray((jax.jit(fn) if mode == "jit" else fn)(jnp.asarray(x), jnp.asarray(s)))
    want, flushable = _ieee_products(x, s[:, None])
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    same |= flushable & (got == 0) & (np.signbit(got) == np.signbit(want))
    assert same.all(), f"{(~same).sum()} differ; first: got {got[~same][0]!r}, want {want[~same][0]!r}"


def test_cast_satfinite_saturates_and_keeps_nan():
    x = jnp.array([1e6, -1e6, np.nan, 464.0, 300.0], jnp.float32)
    e4 = F.cast_satfinite(x, F.E4M3).astype(jnp.float32)
    assert list(np.asarray(e4[:2])) == [448.0, -448.0] and np.isnan(e4[2]) and e4[3] == 448.0
    e5 = F.cast_satfinite(jnp.array([1e9, -1e9], jnp.float32), F.E5M2).astype(jnp.float32)
    assert list(np.asarray(e5)) == [57344.0, -57344.0]


def test_exact_f32_widens_every_bf16_as_a_convert_does():
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    want = np.asarray(x.astype(jnp.float32)).view(np.uint32)
    got = np.asarray(jax.jit(F.exact_f32)(x)).view(np.uint32)
    np.testing.assert_array_equal(got, want)  # NaN payloads, infinities and subnormals included
    f = jnp.asarray([1.0, -3.5e-40, np.inf], jnp.float32)
    np.testing.assert_array_equal(np.asarray(F.exact_f32(f)).view(np.uint32), np.asarray(f).view(np.uint32))
