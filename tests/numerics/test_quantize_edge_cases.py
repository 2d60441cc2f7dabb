"""Hand-made cases of docs/numerics.md, eager and under jit, against the oracle and hand values.

E2M1 ties and saturation, MXFP8 blocks whose amax sits on a rounding edge of the RCEIL
rule (and of FLOOR), zero, NaN and inf blocks, FP32 subnormal inputs.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from tests.numerics.test_numpy_reference import RCEIL_HAND_CASES
from tests.support import quantize_checks as qc

F32 = np.float32
ALL_FORMATS = ["fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4"]


def _dequantized(q):
    return np.asarray(lp.dequantize(q))


def test_e2m1_tie_table_and_saturation_through_nvfp4():
    # Tensor amax 6 makes S_enc = 448, s_b = 448 and enc_b = 1 exactly (worked out in
    # test_numpy_reference.test_nvfp4_block_worked_by_hand), so the first block is rounded as is:
    # 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4 (docs/numerics.md, "Element formats").
    x = np.zeros((4, 64), F32)
    x[0, :16] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0]
    # Second block, amax 5.6: s_b = e4m3(5.6 * 74.67 = 418.1) = 416, enc_b = 448/416 = 1.077,
    # 5.6 * enc_b = 6.03: "|v| > 6 → 6" (code 7); -5.6 gives -6 (code 15).
    x[0, 16:19] = [5.6, -5.6, 1.0]
    for mode, q in qc.check_eager_and_jit(lp, x, "nvfp4")[0]:
        data = qc.codes(q.data)
        assert data[0, :16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0], mode
        assert data[0, 16:18].tolist() == [7, 15], mode
        assert qc.codes(q.scale)[0, :2].tolist() == [0x7E, 0x7D], mode  # 448 = 0.1111.110, 416 = 0.1111.101
        assert np.asarray(q.global_scale) == F32(1) / F32(448), mode


def _blocks_with_amax(amaxes, rng):
    """One 32-element row per amax: the amax itself at a random place, the rest smaller, all
    FP32 normal (magnitudes >= amax/100 > FLT_MIN for the tiny cases). Always 16 rows (zero
    rows after the cases), so that eager mode compiles each op once for all these tests."""
    rows = np.zeros((16, 32), F32)
    for i, amax in enumerate(amaxes):
        rest = rng.choice([-1, 1], 32) * rng.uniform(0.01, 0.99, 32) * float(amax)
        rows[i] = rest.astype(F32)
        rows[i, rng.integers(32)] = F32(amax) * rng.choice([-1, 1])
    return rows


NORMAL_RANGE = [(a, c) for a, c in RCEIL_HAND_CASES if 1e-30 < a < np.inf]
TINY = [(a, c) for a, c in RCEIL_HAND_CASES if 0 < a <= 1e-30]
# FLOOR, X = 2^(floor(log2 amax) - 8): differs from RCEIL when the significand exceeds 1.75
FLOOR_CODES = {448.0: 127, 449.0: 127, 500.0: 127, 1.75: 119, 1.76: 119, 3.5: 120}


def test_mxfp8_rceil_codes_on_hand_amaxes():
    amaxes, want = zip(*NORMAL_RANGE)  # 448, 449, 500, 1.75, 1.76, 3.5, one ulp above 448 x 2^k, ...
    x = _blocks_with_amax(amaxes, np.random.default_rng(0))
    for mode, q in qc.check_eager_and_jit(lp, x, "mxfp8")[0]:
        assert qc.codes(q.scale)[: len(want), 0].tolist() == list(want), mode


def test_mxfp8_floor_codes_on_hand_amaxes():
    x = _blocks_with_amax(list(FLOOR_CODES), np.random.default_rng(1))
    for mode, q in qc.check_eager_and_jit(lp, x, "mxfp8", scale_rule="floor")[0]:
        assert qc.codes(q.scale)[: len(FLOOR_CODES), 0].tolist() == list(FLOOR_CODES.values()), mode
        assert np.abs(_dequantized(q)).max(axis=1)[1] == 448, mode  # 449 saturates at X = 1


def test_mxfp8_tiny_amax_where_d_is_an_fp32_subnormal():
    # Normal inputs whose d = amax * fp32(1/448) is an FP32 subnormal: "an FP32 subnormal d
    # (exponent field 0) with mantissa <= 0x400000 is not incremented". 449 x 2^-127 needs
    # code 1 (X = 2^-126); 448 x 2^-127 and 300 x 2^-127 code 0 (X = 2^-127).
    amaxes, want = zip(*TINY)
    x = _blocks_with_amax(amaxes, np.random.default_rng(2))
    for mode, q in qc.check_eager_and_jit(lp, x, "mxfp8", check_dequantized_values=False)[0]:
        assert qc.codes(q.scale)[: len(want), 0].tolist() == list(want), mode


def test_mxfp8_code_0_blocks_dequantize_exactly():
    # Decoded q * 2^(e-127): for code 0 the factor 2^-127 is an FP32 subnormal, but
    # q * 2^-127 with |q| >= 2^-9 is not (448 x 2^-127 = 2.6e-36): the products are
    # FP32-normal and must come out exact, not flushed to zero.
    x = _blocks_with_amax([a for a, _ in TINY], np.random.default_rng(2))
    qc.check_eager_and_jit(lp, x, "mxfp8")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_zero_blocks(fmt):
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(F32)
    x[0] = 0
    x[1, :32] = 0
    for mode, q in qc.check_eager_and_jit(lp, x, fmt)[0]:
        assert not qc.codes(q.data)[0].any() and not qc.codes(q.data)[1, :32].any(), mode
        assert not _dequantized(q)[0].any(), mode
        if fmt != "fp8_e4m3" and fmt != "fp8_e5m2":  # a zero block: code 0, or s_b = 0
            assert not qc.codes(q.scale)[0].any() and not qc.codes(q.scale)[1, 0], mode


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_all_zero_tensor(fmt):
    for mode, q in qc.check_eager_and_jit(lp, np.zeros((4, 64), F32), fmt)[0]:
        assert not _dequantized(q).any(), mode
        if fmt.startswith("fp8"):
            assert np.asarray(q.scale) == 1, mode  # amax 0: scale 1
        if fmt == "nvfp4":
            assert np.asarray(q.global_scale) == 1, mode  # amax_t 0: S_enc = 1


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_nan_stays_in_its_block(fmt):
    x = np.random.default_rng(4).standard_normal((4, 64)).astype(F32)
    x[1, 40] = np.nan
    block = {"fp8_e4m3": np.s_[1, 40], "fp8_e5m2": np.s_[1, 40], "mxfp8": np.s_[1, 32:64],
             "nvfp4": np.s_[1, 32:48]}[fmt]
    nan_where = np.zeros(x.shape, bool)
    nan_where[block] = True
    for mode, q in qc.check_eager_and_jit(lp, x, fmt)[0]:
        deq = _dequantized(q)
        np.testing.assert_array_equal(np.isnan(deq), nan_where, err_msg=mode)
        if fmt.startswith("fp8"):
            assert np.asarray(q.scale) == 1, mode  # a NaN amax makes the tensor scale 1
        if fmt == "mxfp8":
            assert qc.codes(q.scale)[1, 1] == 255, mode  # a NaN amax: code 255
        if fmt == "nvfp4":
            assert np.asarray(q.global_scale) == 1, mode


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_inf_blocks(fmt):
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(F32)
    x[2, 5], x[3, 60] = np.inf, -np.inf
    for mode, q in qc.check_eager_and_jit(lp, x, fmt)[0]:
        deq = _dequantized(q)
        assert not np.isnan(deq).any(), mode
        if fmt == "mxfp8":  # an infinite amax: code 254; 448 x 2^127 dequantizes to inf again
            assert qc.codes(q.scale)[2, 0] == 254 and qc.codes(q.scale)[3, 1] == 254, mode
            assert deq[2, 5] == np.inf and deq[3, 60] == -np.inf, mode
        if fmt == "fp8_e4m3":  # scale 1, satfinite: ±inf -> ±448
            assert np.asarray(q.scale) == 1 and deq[2, 5] == 448 and deq[3, 60] == -448, mode
        if fmt == "nvfp4":  # S_enc = 1, s_b = satfinite(inf / 6) = 448, q = 6: 6 x 448 = 2688
            assert np.asarray(q.global_scale) == 1 and deq[2, 5] == 2688, mode


@pytest.mark.parametrize("fmt", ALL_FORMATS + ["fp8_block"])
def test_fp32_subnormal_inputs(fmt):
    # XLA on CPU flushes FP32 subnormals: their bytes are not compared and their dequantized
    # values need only be within FLT_MIN of the oracle (quantize_checks explains the rule),
    # except FP8 block scaling's, which are compared bit for bit.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 64)).astype(F32)
    sub = rng.random((4, 64)) < 0.3
    x[sub] = (rng.uniform(-1, 1, sub.sum()) * qc.FLT_MIN).astype(F32)
    x[1] = (rng.uniform(-1, 1, 64) * qc.FLT_MIN).astype(F32)  # a row of subnormals only
    x[2, :32] *= F32(1e-30)  # tiny normal values beside subnormals
    assert qc.subnormal(x).sum() > 64
    qc.check_eager_and_jit(lp, x, fmt, subnormal_inputs=True)


def test_length_33_pads_with_zeros_and_drops_the_padding():
    x = np.random.default_rng(7).standard_normal((3, 33)).astype(F32)
    for fmt, n_blocks in (("mxfp8", 2), ("nvfp4", 3)):
        for mode, q in qc.check_eager_and_jit(lp, x, fmt, modes=("jit",))[0]:
            assert q.data.shape == (3, 33) and q.scale.shape == (3, n_blocks), mode
            assert lp.dequantize(q).shape == (3, 33), mode
    # The 33rd element is a block of its own, padded with zeros: the same as an explicit
    # zero-padded 64-wide row.
    padded = np.zeros((3, 64), F32)
    padded[:, :33] = x
    quantize = qc.jitted_quantize(lp, "mxfp8")
    q33, q64 = quantize(jnp.asarray(x)), quantize(jnp.asarray(padded))
    np.testing.assert_array_equal(qc.codes(q33.scale), qc.codes(q64.scale))
    np.testing.assert_array_equal(qc.codes(q33.data), qc.codes(q64.data)[:, :33])
