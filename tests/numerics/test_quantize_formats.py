"""lp_jax.quantize / dequantize against the NumPy oracle, bit for bit, on random inputs.

Every format, ranks 1 to 4, blocking along the last and non-last axes, lengths that are
not a multiple of the block (33), 16x16 tiles for NVFP4, four input distributions (normal;
normal with rare 1e3 outliers; log-uniform 1e-30..1e30 with random signs; bf16 values);
then jit and vmap give the same bits.
"""
import functools

import jax
import numpy as np
import pytest

import lp_jax as lp
from tests.support import numpy_reference as ref
from tests.support import quantize_checks as qc
from tests.support.random_inputs import DISTRIBUTIONS

# (shape, axis): ranks 1-4, blocks along last and non-last axes, padded lengths (33, 5, 7, 3)
LAYOUTS = [((33,), -1), ((6, 64), -1), ((64, 5), 0), ((5, 33), -1), ((3, 7, 48), 1),
           ((2, 3, 4, 32), -1), ((2, 40, 3, 2), 1)]
# (fmt, keyword options, layouts): per-tensor scaling ignores the axis, so two layouts do
VARIANTS = [("fp8_e4m3", {}, LAYOUTS[::5]), ("fp8_e5m2", {}, LAYOUTS[1::5]),
            ("mxfp8", {}, LAYOUTS), ("mxfp8", {"scale_rule": "floor"}, LAYOUTS[::2]),
            ("nvfp4", {}, LAYOUTS)]
CASES = [(fmt, kw, shape, axis) for fmt, kw, layouts in VARIANTS for shape, axis in layouts]
TILED_SHAPES = [(48, 32), (33, 20), (2, 17, 40)]


def _case_id(case):
    fmt, kw, shape, axis = case
    return fmt + "".join(f"-{k}={v}" for k, v in kw.items()) + f"-{shape}-axis{axis}"


def _jitted(fmt, axis, options):
    """jit compiles a whole quantizer ~5x faster than eager mode compiles its ops one by one;
    test_jit_gives_the_same_bits covers eager mode."""
    return qc.jitted_quantize(lp, fmt, axis, options)


def _check(x, fmt, axis=-1, **kw):
    q = _jitted(fmt, axis, tuple(sorted(kw.items())))(qc.to_jax(x))
    r = qc.check_quantized(lp, q, x, fmt, axis=axis, **kw)
    qc.check_dequantized(lp, q, r, x, jit=True)
    return q


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_random_inputs_match_reference(case):
    fmt, kw, shape, axis = case
    for seed, (name, make) in enumerate(DISTRIBUTIONS.items()):
        x = make(np.random.default_rng(seed), shape)
        try:
            _check(x, fmt, axis, **kw)
        except AssertionError as e:
            raise AssertionError(f"{name} input, shape {shape}, axis {axis}: {e}") from None


@pytest.mark.parametrize("shape", TILED_SHAPES, ids=str)
def test_nvfp4_16x16_tiles_match_reference(shape):
    for seed, (name, make) in enumerate(DISTRIBUTIONS.items()):
        x = make(np.random.default_rng(10 + seed), shape)
        try:
            q = _check(x, "nvfp4", block_2d=True)
        except AssertionError as e:
            raise AssertionError(f"{name} input, shape {shape}: {e}") from None
        tiles = (-(-shape[-2] // 16), -(-shape[-1] // 16))
        assert q.scale.shape == shape[:-2] + tiles


def test_scale_shapes_round_the_blocked_axis_up():
    x = jax.ShapeDtypeStruct((33, 5, 65), np.float32)

    def scale_shape(fmt, **kw):
        return jax.eval_shape(lambda a: lp.quantize(a, fmt, **kw), x).scale.shape

    assert scale_shape("mxfp8", axis=0) == (2, 5, 65)
    assert scale_shape("mxfp8", axis=-1) == (33, 5, 3)
    assert scale_shape("nvfp4", axis=1) == (33, 1, 65)
    assert scale_shape("nvfp4", block_2d=True) == (33, 1, 5)
    assert scale_shape("fp8_e4m3") == ()


ALL_VARIANTS = [v[:2] for v in VARIANTS] + [("nvfp4", {"block_2d": True})]


def _variant_id(v):
    return v[0] + "".join(f"-{k}={val}" for k, val in v[1].items())


def _assert_same_bits(a, b):
    for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.atleast_1d(leaf_a).view(np.uint8), np.atleast_1d(leaf_b).view(np.uint8))


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=_variant_id)
def test_jit_gives_the_same_bits(variant):
    fmt, kw = variant
    # (4, 64) along the last axis: the shape of the eager edge-case tests, whose compiled
    # ops eager mode then reuses
    x = qc.to_jax(DISTRIBUTIONS["outliers"](np.random.default_rng(3), (4, 64)))
    eager = lp.quantize(x, fmt, -1, **kw)
    jitted = jax.jit(functools.partial(lp.quantize, fmt=fmt, axis=-1, **kw))(x)
    _assert_same_bits(eager, jitted)
    _assert_same_bits(lp.dequantize(eager), jax.jit(lp.dequantize)(jitted))
    qc.check_quantized(lp, jitted, np.asarray(x), fmt, **kw)


@pytest.mark.parametrize("variant", [ALL_VARIANTS[i] for i in (0, 2, 4, 5)], ids=_variant_id)
def test_vmap_equals_quantizing_each_slice(variant):
    # vmap over a leading axis quantizes each slice on its own (per-slice tensor amax).
    fmt, kw = variant
    x = qc.to_jax(DISTRIBUTIONS["outliers"](np.random.default_rng(4), (3, 4, 64)))
    batched = jax.vmap(lambda s: lp.quantize(s, fmt, -1, **kw))(x)
    one = _jitted(fmt, -1, tuple(sorted(kw.items())))
    slices = [one(x[i]) for i in range(x.shape[0])]
    _assert_same_bits(batched, jax.tree.map(lambda *a: np.stack(a), *slices))
    np.testing.assert_array_equal(np.asarray(jax.vmap(lp.dequantize)(batched)),
                                  np.stack([np.asarray(lp.dequantize(s)) for s in slices]))
    for i in range(x.shape[0]):  # and each slice is what the oracle says
        qc.check_quantized(lp, jax.tree.map(lambda a: a[i], batched), np.asarray(x[i]), fmt, **kw)


def test_bf16_and_fp32_holding_the_same_values_agree():
    x16 = DISTRIBUTIONS["bf16"](np.random.default_rng(5), (4, 64))
    for fmt in ("fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4"):
        quantize = _jitted(fmt, -1, ())
        _assert_same_bits(quantize(qc.to_jax(x16)), quantize(qc.to_jax(x16.astype(np.float32))))


def test_oracle_is_not_trivially_satisfied():
    # Guards the comparison itself: a one-ulp change of one scale must be caught.
    x = DISTRIBUTIONS["normal"](np.random.default_rng(6), (2, 64))
    q = _jitted("mxfp8", -1, ())(qc.to_jax(x))
    r = ref.quantize(x, "mxfp8")
    wrong = r.scale.copy()
    wrong[0, 0] += 1
    with pytest.raises(AssertionError):
        qc.assert_codes_equal(qc.codes(q.scale), wrong, qc.E8M0)
