"""Self-checks of the NumPy oracle (tests/support/numpy_reference*.py) against ml_dtypes and by hand.

The oracle decides what lp_jax must produce, so it is checked on its own first: its casts
against ml_dtypes on every code and on every rounding tie, its scale rules on cases whose
codes are worked out by hand below (not by running the oracle).
"""
import ml_dtypes
import numpy as np
import pytest

from tests.support import numpy_reference as ref
from tests.support import numpy_reference_casts as casts
from tests.support.numpy_reference_casts import E2M1, E4M3, E5M2

F32 = np.float32
ML_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2, E2M1: ml_dtypes.float4_e2m1fn}
FORMATS = [E4M3, E5M2, E2M1]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_decode_matches_ml_dtypes_on_every_code(fmt):
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    expected = codes.view(ML_DTYPES[fmt]).astype(np.float32)
    np.testing.assert_array_equal(casts.decode(codes, fmt), expected)  # NaN == NaN here
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.signbit(casts.decode(codes, fmt))[finite], np.signbit(expected)[finite])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cast_of_every_finite_value_gives_its_own_code(fmt):
    codes, values = casts.all_finite_values(fmt)
    np.testing.assert_array_equal(casts.cast_satfinite(values, fmt), codes)


def _ml_dtypes_cast(x, fmt):
    return np.asarray(x, np.float32).astype(ML_DTYPES[fmt]).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_ties_and_their_neighbours_match_ml_dtypes(fmt):
    _, values = casts.all_finite_values(fmt)
    pos = np.unique(values[values >= 0])
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)  # exact in float32
    probes = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(np.inf))])
    probes = np.concatenate([probes, -probes])
    np.testing.assert_array_equal(casts.cast_satfinite(probes, fmt), _ml_dtypes_cast(probes, fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_random_values_match_ml_dtypes_inside_the_range(fmt):
    rng = np.random.default_rng(0)
    x = (rng.choice([-1, 1], 20000) * 10.0 ** rng.uniform(-12, np.log10(fmt.max_value), 20000)).astype(np.float32)
    np.testing.assert_array_equal(casts.cast_satfinite(x, fmt), _ml_dtypes_cast(x, fmt))


def test_saturation_and_nan():
    big = np.array([449, 464, 465, 1e30, np.inf, -np.inf, -500], np.float32)
    # E4M3 max 448 = 0.1111.110 (0x7e); negative max 0xfe. ml_dtypes would give NaN here.
    np.testing.assert_array_equal(casts.cast_satfinite(big, E4M3), [0x7E] * 5 + [0xFE] * 2)
    # E5M2 max 57344 = 0.11110.11 (0x7b): satfinite turns inf into max too.
    np.testing.assert_array_equal(casts.cast_satfinite(np.array([6e4, np.inf, -np.inf], np.float32), E5M2),
                                  [0x7B, 0x7B, 0xFB])
    assert casts.cast_satfinite(np.array([np.nan]), E4M3)[0] & 0x7F == 0x7F
    assert np.isnan(casts.decode(casts.cast_satfinite(np.array([np.nan]), E5M2), E5M2)[0])


def test_e2m1_tie_table():
    # docs/numerics.md, "Element formats": 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4;
    # |v| > 6 → 6.
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6.5, 1e9, np.inf], np.float32)
    want = np.array([0, 1, 1, 2, 2, 4, 4, 6, 6, 6], np.float32)
    np.testing.assert_array_equal(casts.decode(casts.cast_satfinite(x, E2M1), E2M1), want)
    np.testing.assert_array_equal(casts.decode(casts.cast_satfinite(-x, E2M1), E2M1), -want)
    # codes: 1.0 = 0.01.0 (2), 2.0 = 0.10.0 (4), 4.0 = 0.11.0 (6), 6.0 = 0.11.1 (7); sign bit 3
    np.testing.assert_array_equal(casts.cast_satfinite(x, E2M1), [0, 2, 2, 4, 4, 6, 6, 7, 7, 7])
    np.testing.assert_array_equal(casts.cast_satfinite(-x, E2M1), [8, 10, 10, 12, 12, 14, 14, 15, 15, 15])


def test_round_to_bf16_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-30, 30, 20000)).astype(np.float32)
    bits = x.view(np.uint32) & ~np.uint32(0xFFFF) | np.uint32(0x8000)  # exact bf16 ties
    for probe in (x, bits.view(np.float32)):
        np.testing.assert_array_equal(casts.round_to_bf16(probe).astype(np.float32),
                                      probe.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_e8m0_decode_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(ref.e8m0_value(codes), codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


# fp32(1/448) = 2^-9 * fp32(8/7); 8/7 = 1.001001001..._2 rounds UP at bit 24, so
# fp32(1/448) = (1/448) * (1 + 0.375 * 2^-23). Hence d = amax * fp32(1/448):
RCEIL_HAND_CASES = [
    (448.0, 127),  # d = 1 + 0.375 ulp -> 1.0, mantissa 0: code 127, X = 1
    (449.0, 128),  # d = 1.0022: exponent 127, mantissa != 0 -> 128, X = 2
    (500.0, 128),  # d = 1.116 -> 128
    (1.75, 119),  # 1.75/448 = 2^-8 exactly (+0.375 ulp rounds away): 127 - 8 = 119
    (1.76, 120),  # just above 2^-8: 119 + 1
    (3.5, 120),  # 3.5/448 = 2^-7: 120
    (float(np.nextafter(F32(448), F32(1e9))), 128),  # 448(1 + 2^-23/1.75): d = 1 + 0.946 ulp -> 1 + 1 ulp
    (float(np.nextafter(F32(448 * 2.0**-10), F32(1))), 118),  # same, 2^-10 lower: 117 + 1
    (float(np.nextafter(F32(448 * 2.0**100), F32(np.inf))), 228),  # 2^100: 227 + 1
    (448 * 2.0**-127, 0),  # d = 2^-127 (subnormal, mantissa 0x400000): not incremented, X = 2^-127
    (449 * 2.0**-127, 1),  # d just above 2^-127 (mantissa > 0x400000): 0 + 1, X = 2^-126
    (300 * 2.0**-127, 0),  # d < 2^-127: code 0
    (448 * 2.0**-126, 1),  # d = 2^-126, the smallest normal: exponent 1, mantissa 0
    (float(np.finfo(np.float32).max), 247),  # d = 2^128/448 ~ 2^119.2: exponent 246, +1
    (0.0, 0), (np.inf, 254), (np.nan, 255),
]


@pytest.mark.parametrize("amax,code", RCEIL_HAND_CASES)
def test_rceil_codes_worked_by_hand(amax, code):
    assert int(ref.rceil_code(F32(amax))) == code
    if 0 < amax < np.inf:  # X = 2^(code-127) brings the amax to at most 448 and above 224
        x = F32(amax) / np.ldexp(1.0, code - 127)
        assert x <= 448 and (x > 224 or code == 0)


@pytest.mark.parametrize("amax,code", [(448.0, 127), (449.0, 127), (500.0, 127), (1.75, 119),
                                       (1.76, 119), (3.5, 120), (2.0**-100, 19)])
def test_floor_codes_worked_by_hand(amax, code):
    # FLOOR: X = 2^(floor(log2 amax) - 8); 449 and 500 have floor(log2) = 8 -> X = 1 (code 127)
    assert int(ref.floor_code(F32(amax))) == code


def test_per_tensor_scale_rules():
    assert ref.per_tensor_scale(F32(448), 448) == 1
    assert ref.per_tensor_scale(F32(3), 448) == F32(448) / F32(3)  # IEEE fp32 division
    for amax in (0.0, np.inf, np.nan):
        assert ref.per_tensor_scale(F32(amax), 448) == 1
    assert ref.per_tensor_scale(F32(1e-38), 448) == np.finfo(np.float32).max  # 4.5e40 overflows
    assert ref.per_tensor_scale(F32(1e-34), 57344) == np.finfo(np.float32).max  # 5.7e38 overflows


def test_nvfp4_tensor_scale_rules():
    assert ref.nvfp4_tensor_scales(F32(6)) == (F32(448), F32(1) / F32(448))
    for amax in (0.0, np.inf, np.nan):
        assert ref.nvfp4_tensor_scales(F32(amax)) == (1, 1)
    s_enc, s_dec = ref.nvfp4_tensor_scales(F32(1e-37))  # 2688 / 1e-37 overflows: clamped
    # 1/FLT_MAX = 2^-128 / (1 - 2^-24): an FP32 subnormal, rounded to 2^-128
    assert s_enc == np.finfo(np.float32).max and s_dec == F32(2.0**-128)


def test_nvfp4_block_worked_by_hand():
    # amax_t = 6: S_enc = 448, S_enc * fp32(1/6) = 74.666..., 6 * that = 448.00003 -> s_b = 448
    # (0x7e); S_dec = fp32(1/448); 448 * S_dec = 1 + 0.375 ulp -> 1.0, so enc_b = 1 and the
    # block holds the tie table itself. Dequantized: q * 448 * S_dec = q (1 + 0.375 * 2^-23),
    # which rounds back to q except for 6 = 6 + 2.25 * 2^-23, more than half of ulp(6) = 4 * 2^-23.
    x = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0],
                 np.float32)
    q = ref.quantize(x, "nvfp4")
    assert q.scale.tolist() == [0x7E] and q.global_scale == F32(1) / F32(448)
    assert q.data.tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    six_up = np.nextafter(F32(6), F32(7))
    np.testing.assert_array_equal(q.dequantized, [six_up, 0, 1, 1, 2, 2, 4, 4, -0., -1, -1, -2, -2, -4, -4, 0])


def test_mxfp8_block_worked_by_hand():
    # amax 449 -> code 128 (X = 2); 449/2 = 224.5 -> E4M3 224 (grid 16 in [128, 256)) = 0.1110.110;
    # -3/2 = -1.5 = 1.0111.100; 1e-3/2 -> 5e-4 below half of 2^-9: 0.
    x = np.zeros(32, np.float32)
    x[:3] = [449, -3, 1e-3]
    q = ref.quantize(x, "mxfp8")
    assert q.scale.tolist() == [128]
    assert q.data[:3].tolist() == [0x76, 0xBC, 0x00]
    np.testing.assert_array_equal(q.dequantized[:3], [448, -3, 0])


def test_blocking_along_any_axis_is_a_transpose_of_the_last_axis():
    x = np.random.default_rng(2).standard_normal((40, 3, 33)).astype(np.float32)
    for fmt in ("mxfp8", "nvfp4"):
        along0 = ref.quantize(x, fmt, axis=0)
        last = ref.quantize(np.moveaxis(x, 0, -1), fmt, axis=-1)
        np.testing.assert_array_equal(along0.data, np.moveaxis(last.data, -1, 0))
        np.testing.assert_array_equal(along0.scale, np.moveaxis(last.scale, -1, 0))
        assert along0.scale.shape == ((2 if fmt == "mxfp8" else 3), 3, 33)


def test_hadamard_matrix_is_orthogonal_signed_sylvester():
    h = ref.hadamard_matrix()
    np.testing.assert_array_equal(h @ h.T, np.eye(16, dtype=np.float32))
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    sylvester = (-1.0) ** np.vectorize(lambda a: bin(a).count("1"))(i & j)  # H16[i,j] = (-1)^popcount(i&j)
    np.testing.assert_array_equal(h, 0.25 * ref.HADAMARD_SIGNS[:, None] * sylvester)
