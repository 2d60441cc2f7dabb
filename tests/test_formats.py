"""lp_jax.numerics.formats: the bit-level helpers, checked against exact rational arithmetic."""
from fractions import Fraction

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


def test_cast_satfinite_saturates_and_keeps_nan():
    x = jnp.array([1e6, -1e6, np.nan, 464.0, 300.0], jnp.float32)
    e4 = F.cast_satfinite(x, F.E4M3).astype(jnp.float32)
    assert list(np.asarray(e4[:2])) == [448.0, -448.0] and np.isnan(e4[2]) and e4[3] == 448.0
    e5 = F.cast_satfinite(jnp.array([1e9, -1e9], jnp.float32), F.E5M2).astype(jnp.float32)
    assert list(np.asarray(e5)) == [57344.0, -57344.0]
