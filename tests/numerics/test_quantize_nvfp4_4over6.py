"""NVFP4 with 4/6 block scales (docs/numerics.md, "NVFP4 with 4/6 block scales"):
lp.quantize(x, "nvfp4", block_scale_search="4over6") against the NumPy oracle bit for bit
(codes, block scales, dequantized values), both metrics, 1x16 blocks and 16x16 tiles, ragged
edges, zero and non-finite inputs; the choice is not vacuous and ignores the random bits."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lp_jax as lp
from tests.support import quantize_checks as qc
from tests.support.numpy_reference_casts import E2M1, E4M3, decode
from tests.support.numpy_reference_four_over_six import quantize_nvfp4_4over6

F32 = np.float32


def _inputs(shape, seed):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape).astype(F32)
    spiky = (base * np.exp(rng.uniform(-6, 3, shape))).astype(F32)
    # Values on E2M1's grid at one block amax: "4" reconstructs some blocks exactly.
    grid = rng.choice(np.array([0, 0.5, 1, 1.5, 2, 3, 4], F32), shape) * rng.choice([-1, 1], shape)
    return {"normal": base, "spiky": spiky, "grid": grid.astype(F32), "zeros": np.zeros(shape, F32)}


@functools.lru_cache(maxsize=None)
def _jitted(axis, block_2d, metric):
    return jax.jit(lambda x: lp.quantize(x, "nvfp4", axis=axis, block_2d=block_2d,
                                         block_scale_search="4over6", metric=metric))


def _quantize(x, axis=-1, block_2d=False, metric="mae"):
    return _jitted(axis, block_2d, metric)(jnp.asarray(x))


def _check(x, axis=-1, block_2d=False, metric="mae"):
    q = _quantize(x, axis, block_2d, metric)
    r = quantize_nvfp4_4over6(np.asarray(x), axis, block_2d, metric)
    assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn
    qc.assert_codes_equal(qc.codes(q.scale), r.scale, E4M3, what="block scales")
    qc.assert_codes_equal(qc.codes(q.data), r.data, E2M1, where=r.data_known)
    qc.assert_f32_equal(lp.dequantize(q), r.dequantized, what="dequantized")
    return q, r


@pytest.mark.parametrize("metric", ["mae", "mse"])
@pytest.mark.parametrize("shape, axis", [((8, 64), -1), ((40, 37), 0), ((3, 5, 50), -1)])
def test_1x16_blocks_match_the_oracle(shape, axis, metric):
    for case, x in _inputs(shape, 0).items():
        _check(x, axis, metric=metric)
        _check(x.astype(ml_dtypes.bfloat16), axis, metric=metric)


@pytest.mark.parametrize("metric", ["mae", "mse"])
@pytest.mark.parametrize("shape", [(64, 48), (37, 50), (2, 16, 33)])
def test_16x16_tiles_match_the_oracle(shape, metric):
    for x in _inputs(shape, 1).values():
        q, _ = _check(x, block_2d=True, metric=metric)
        assert q.block_2d and q.scale.shape == shape[:-2] + (-(-shape[-2] // 16), -(-shape[-1] // 16))


def test_non_finite_inputs_match_the_oracle():
    x = _inputs((32, 48), 2)["normal"]
    for where, value in (((3, 17), np.nan), ((20, 5), np.inf), ((7, 40), -np.inf)):
        y = x.copy()
        y[where] = value
        _check(y)
        _check(y, block_2d=True)


@pytest.mark.parametrize("metric", ["mae", "mse"])
@pytest.mark.parametrize("magnitude", [1e-36, 1e-38, 3e-39, 1e-40])
def test_tiny_and_subnormal_tensors_match_the_oracle(magnitude, metric):
    """Tensors near and below FLT_MIN (their amax, S_dec, encode factors and reconstruction
    errors are float32 subnormals or products of them), and subnormal elements beside normal
    ones: the choice, codes and decoded values are the oracle's on CPU too, where XLA
    flushes subnormals (the products and sums keep them: numerics.gradual_underflow)."""
    rng = np.random.default_rng(6)
    tiny = (rng.standard_normal((32, 48)) * magnitude).astype(F32)
    assert qc.subnormal(tiny).any()
    mixed = _inputs((32, 48), 6)["spiky"]
    mixed[rng.random(mixed.shape) < 0.3] *= F32(magnitude)
    for x in (tiny, mixed):
        _check(x, metric=metric)
        _check(x, axis=0, metric=metric)
        _check(x, block_2d=True, metric=metric)
    if magnitude in (1e-38, 3e-39):  # decoded values below FLT_MIN, not all of them zero
        _, r = _check(tiny, metric=metric)
        assert np.any(qc.subnormal(r.dequantized))


def test_the_choice_is_not_vacuous_and_the_metrics_differ():
    """Both candidates win somewhere; "4" blocks carry the 1.5x larger scale; MAE and MSE
    choose differently on some blocks; the error of what is chosen is never larger than
    plain NVFP4's 6-scaling under the same tensor scale."""
    x = _inputs((256, 64), 3)["spiky"]
    chosen = {}
    for metric in ("mae", "mse"):
        _, r = _check(x, metric=metric)
        amax_t = F32(np.max(np.abs(x)))
        s_enc = min(F32(1536) / amax_t, F32(np.finfo(F32).max))
        amax_b = np.abs(x).reshape(256, 4, 16).max(-1)
        base = (amax_b / F32(6)).astype(F32) * s_enc
        chosen[metric] = r.scale_factor > base * F32(1.25)  # s4 ~ 1.5 base, s6 ~ base
        assert 0.05 < chosen[metric].mean() < 0.95, chosen[metric].mean()
    assert (chosen["mae"] != chosen["mse"]).any()


def test_stochastic_rounding_encodes_with_the_scale_chosen_by_nearest():
    x = jnp.asarray(_inputs((64, 64), 4)["spiky"])
    nearest = lp.quantize(x, "nvfp4", block_scale_search="4over6")
    sr = jax.jit(lambda x, key: lp.quantize(x, "nvfp4", block_scale_search="4over6",
                                            rounding="stochastic", key=key))
    draws = [sr(x, jax.random.key(k)) for k in range(32)]
    for q in draws:
        np.testing.assert_array_equal(qc.codes(q.scale), qc.codes(nearest.scale))
    assert (qc.codes(draws[0].data) != qc.codes(draws[1].data)).any()  # the bits do differ
    # unbiased: the mean of many draws approaches x
    mean = np.mean([np.asarray(lp.dequantize(q)) for q in draws], axis=0)
    err_sr = np.abs(mean - np.asarray(x)).mean()
    assert err_sr < np.abs(np.asarray(lp.dequantize(nearest)) - np.asarray(x)).mean() / 2


def test_a_dequantized_block_is_code_times_its_decode_factor():
    x = _inputs((16, 32), 5)["normal"]
    q = _quantize(x)
    amax = F32(np.max(np.abs(x)))
    s = decode(qc.codes(q.scale), E4M3).astype(F32)
    factor = ((s * amax).astype(F32) * (F32(1) / F32(1536))).astype(F32)
    want = decode(qc.codes(q.data), E2M1).astype(F32) * np.repeat(factor, 16, axis=-1)
    qc.assert_f32_equal(lp.dequantize(q), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fmt="mxfp8", block_scale_search="4over6"), "only defined for fmt='nvfp4'"),
    (dict(fmt="nvfp4", block_scale_search="3over5"), "block_scale_search='3over5' is not valid"),
    (dict(fmt="nvfp4", block_scale_search="4over6", metric="max"), "metric='max' is not valid"),
    (dict(fmt="nvfp4", block_scale_search="4over6", impl="pallas"), "no Pallas quantization kernel"),
])
def test_bad_arguments_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lp.quantize(jnp.ones((4, 32)), **kwargs)
