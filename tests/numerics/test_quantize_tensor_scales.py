"""Tensor-scale edge cases (FP8-CS scale, NVFP4 S_enc) and invalid arguments of lp.quantize."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from tests.support import quantize_checks as qc
from tests.support.numpy_reference_casts import E4M3, E5M2, decode

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _tensor(values):
    x = np.zeros((4, 64), F32)  # one shape for all cases: eager mode compiles each op once
    x.flat[: len(values)] = values
    return x


def test_fp8_scale_is_exactly_one_at_amax_448():
    x = _tensor([448, -200, 3.3, 1e-3])
    for mode, q in qc.check_eager_and_jit(lp, x, "fp8_e4m3")[0]:
        assert np.asarray(q.scale) == 1, mode
        assert decode(qc.codes(q.data).flat[:4], E4M3).tolist() == [448, -192, 3.25, 2.0**-9], mode  # 1e-3 > 2^-10: rounds up to the smallest subnormal


def test_fp8_scale_is_the_ieee_quotient():
    x = _tensor([3, -1, 0.5])
    for mode, q in qc.check_eager_and_jit(lp, x, "fp8_e4m3")[0]:
        assert np.asarray(q.scale) == F32(1) / (F32(448) / F32(3)), mode  # scale_inv = 1 / fp32(448/3)


@pytest.mark.parametrize("fmt,values,first", [
    # 448 / 2e-38 = 2.2e40 overflows: scale = FLT_MAX; 2e-38 x FLT_MAX = 6.806 -> E4M3 7.0
    ("fp8_e4m3", [2e-38, -1.5e-38, 1.2e-38], 7.0),
    # 57344 / 1e-35 = 5.7e39 overflows; 1e-35 x FLT_MAX = 3402.8 -> E5M2 3584 (grid 512 in [2048, 4096))
    ("fp8_e5m2", [1e-35, -7e-36, 2e-36], 3584.0),
])
def test_fp8_scale_overflow_saturates_to_flt_max(fmt, values, first):
    # scale_inv = 1/FLT_MAX = 2^-128 is an FP32 subnormal, so the stored q.scale may flush
    # (quantize_checks); the data bytes t * FLT_MAX are checked exactly.
    runs, r = qc.check_eager_and_jit(lp, _tensor(values), fmt, check_dequantized_values=False)
    assert r.scale == F32(2.0**-128)
    for mode, q in runs:
        assert decode(qc.codes(q.data).flat[:1], E4M3 if fmt == "fp8_e4m3" else E5M2)[0] == first, mode


@pytest.mark.parametrize("fmt,values", [("fp8_e4m3", [2e-38, -1.5e-38, 1.2e-38]),
                                        ("fp8_e5m2", [1e-35, -7e-36, 2e-36])])
def test_fp8_scale_overflow_dequantizes_exactly(fmt, values):
    # The decoding factor scale_inv = 1 / scale is 2^-128 here; q * 2^-128 is FP32-normal
    # for |q| >= 2 (7 x 2^-128 = 2.06e-38), so those dequantized values must be exact.
    qc.check_eager_and_jit(lp, _tensor(values), fmt)


@pytest.mark.parametrize("amax", [3e38, 1e-34, 6.0, 1e-20])
def test_nvfp4_tensor_scale_across_the_range(amax):
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, (4, 64)) * amax).astype(F32)
    x[0, 0] = amax
    for mode, q in qc.check_eager_and_jit(lp, x, "nvfp4")[0]:
        assert np.asarray(q.global_scale) == F32(1) / (F32(2688) / F32(amax)), mode  # S_dec = 1/S_enc


@pytest.mark.parametrize("amax,s_dec", [(1e-35, F32(1) / (F32(2688) / F32(1e-35))), (1e-37, F32(2.0**-128))])
def test_nvfp4_tiny_tensor_amax_with_subnormal_s_dec(amax, s_dec):
    # FP32-normal inputs whose S_dec is an FP32 subnormal. amax 1e-35: S_enc = 2.7e38 (finite),
    # S_dec = 3.7e-39. amax 1e-37: 2688 / 1e-37 overflows, S_enc = FLT_MAX ("clamped to
    # FLT_MAX"), S_dec = 1/FLT_MAX = 2^-128. Either way s_b = e4m3(amax_b * S_enc/6) is normal
    # and enc_b = min(1/(s_b * S_dec), FLT_MAX) is finite, so the data are bounded by the block
    # amax as usual. S_dec itself may come back flushed (quantize_checks), the data may not:
    # a flushed S_dec inside the quantizer gives enc_b = FLT_MAX and pushes every non-zero
    # element to ±6 (and every dequantized value to 0).
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, (4, 64)) * amax).astype(F32)
    x[0, 0] = amax
    x[qc.subnormal(x)] = F32(2e-38)  # inputs stay FP32 normal
    runs, r = qc.check_eager_and_jit(lp, x, "nvfp4")
    assert r.global_scale == s_dec


def test_nvfp4_global_scale_is_one_for_nan_and_inf_tensors():
    for bad in (np.nan, np.inf):
        for mode, q in qc.check_eager_and_jit(lp, _tensor([1.0, bad, -3.0]), "nvfp4")[0]:
            assert np.asarray(q.global_scale) == 1, (bad, mode)


# ---------------------------------------------------------------- invalid arguments
X2 = jnp.ones((4, 32), jnp.float32)


@pytest.mark.parametrize("call,words", [
    (lambda: lp.quantize(X2, "fp7"), ["fmt", "fp7", "mxfp8", "nvfp4"]),
    (lambda: lp.quantize(jnp.ones(32), "nvfp4", block_2d=True), ["block_2d"]),
    (lambda: lp.quantize(X2, "nvfp4", rounding="stochastic"), ["key"]),
    (lambda: lp.quantize(X2, "nvfp4", rounding="up", key=jax.random.key(0)), ["rounding", "up", "stochastic"]),
    (lambda: lp.quantize(X2, "mxfp8", scale_rule="ceil"), ["scale_rule", "ceil", "rceil"]),
    (lambda: lp.quantize(jnp.ones((4, 32), jnp.int32), "mxfp8"), ["int32"]),
], ids=["unknown fmt", "block_2d on 1-D", "stochastic without key", "unknown rounding",
        "unknown scale_rule", "integer input"])
def test_invalid_arguments_raise_value_error_naming_them(call, words):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
