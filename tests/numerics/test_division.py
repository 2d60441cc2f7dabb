"""lp_jax.numerics.division: IEEE float32 division from integer operations (what the scales'
quotients use where lowered for CUDA, whose float division is approximate), bit for bit
against numpy's IEEE division, subnormals, zeros, infinities and NaN included."""
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.numerics.division import div, ieee_div, integer_division

N = 1 << 18


def _bits(rng, kind):
    if kind == "any":
        return rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    if kind == "subnormal":
        return rng.integers(0, 0x800000, N, dtype=np.uint32) | (rng.integers(0, 2, N, dtype=np.uint32) << 31)
    if kind == "near_one":
        return rng.integers(0x3F000000, 0x40000000, N, dtype=np.uint32)
    return rng.integers(0x7E000000, 0x7F800000, N, dtype=np.uint32)  # "huge"


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


_ieee_div = jax.jit(ieee_div)


@pytest.mark.parametrize("a_kind,b_kind", [("any", "any"), ("subnormal", "any"), ("any", "subnormal"),
                                           ("near_one", "near_one"), ("subnormal", "huge"),
                                           ("huge", "subnormal"), ("near_one", "huge"),
                                           ("subnormal", "subnormal")])
def test_integer_division_is_ieee_division(a_kind, b_kind):
    rng = np.random.default_rng(zlib.crc32(f"{a_kind}/{b_kind}".encode()))
    a, b = _bits(rng, a_kind).view(np.float32), _bits(rng, b_kind).view(np.float32)
    with np.errstate(all="ignore"):
        want = a / b
    ok = _same_bits(_ieee_div(a, b), want)
    assert ok.all(), (a[~ok][:4], b[~ok][:4], want[~ok][:4])


def test_integer_division_of_special_values():
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -3.0, 1e-45, -2e-40, 3e38], np.float32)
    a, b = np.meshgrid(specials, specials)
    with np.errstate(all="ignore"):
        want = a / b
    assert _same_bits(_ieee_div(a, b), want).all()


def test_ties_round_to_even_and_sticky_bits_round_up():
    # odd numerators over 2 are exact ties of the 24-bit significand; the others are near ones
    a = np.array([1, 3, 5, 7, 2**24 + 1, 2**24 + 3, 2**25 - 1], np.float32)
    b = np.array([3, 7, 11, 2**24 - 1, 2, 2, 3], np.float32)
    assert _same_bits(_ieee_div(a, b), a / b).all()
    # subnormal results at a tie of the 2^-149 grid, and just above one (sticky)
    tiny_a = np.array([3 * 2.0**-149, 3 * 2.0**-149, 2.0**-126], np.float32)
    tiny_b = np.array([2, 2 - 2.0**-22, 2**23 * 2.0], np.float32)
    assert _same_bits(_ieee_div(tiny_a, tiny_b), tiny_a / tiny_b).all()


@pytest.mark.parametrize("constant", [1536.0, 6.0, 3.0, 1.0, 2.0**-100, 5.0 * 2**40, 63.0, 65.0, 448.0])
def test_division_by_a_constant_is_ieee_division(constant):
    # a divisor known when tracing stays a constant (4/6's 1536 and 6 among them), whose
    # integer divisions compilers rewrite as multiplies: still IEEE's quotient
    rng = np.random.default_rng(int(constant) % 2**32)
    kinds = ("any", "subnormal", "near_one", "huge")
    a = np.concatenate([_bits(rng, kind) for kind in kinds]).view(np.float32)
    with np.errstate(all="ignore"):
        want = a / np.float32(constant)
    ok = _same_bits(jax.jit(lambda x: ieee_div(x, np.float32(constant)))(a), want)
    assert ok.all(), (a[~ok][:4], want[~ok][:4])


def test_div_broadcasts_a_scalar_numerator():
    amax = np.array([1.0, 3.0, 448.0, 1e-30], np.float32)
    assert _same_bits(jax.jit(div)(np.float32(448), amax), np.float32(448) / amax).all()


def _hlo(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _float_divisions(hlo):
    return re.findall(r"stablehlo.divide .*tensor<[0-9x]*f32>", hlo)


def test_div_is_xla_division_on_cpu_and_integer_division_for_cuda():
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    assert _float_divisions(_hlo(div, x, x, platform="cpu"))
    cuda = _hlo(div, x, x, platform="cuda")
    assert not _float_divisions(cuda) and "shift_left" in cuda
    by_constant = _hlo(lambda a: div(a, np.float32(1536)), x, platform="cuda")
    assert not _float_divisions(by_constant) and re.search(r"stablehlo.divide .*ui32>", by_constant)
    with integer_division():  # Pallas kernel bodies: integers on every platform
        # a function of its own: jit's cache would return div's trace from above
        assert not _float_divisions(_hlo(lambda a, b: div(a, b), x, x, platform="cpu"))
