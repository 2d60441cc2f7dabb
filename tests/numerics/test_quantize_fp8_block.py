"""FP8 block scaling (Transformer Engine's Float8BlockScaling; docs/numerics.md, "FP8 block
scaling"): lp.quantize(x, "fp8_block") against the NumPy oracle bit for bit, and the rules
worked out by hand: power-of-two scales, NaN-ignoring amax, zero, inf and subnormal blocks,
ragged edges, 128x128 tiles."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lp_jax as lp
from tests.support import quantize_checks as qc

F32 = np.float32


def _checked(x, axis=-1, fmt="fp8_block", **kw):
    """(the jitted QuantizedTensor, the oracle's) once eager and jit both match the oracle."""
    out, r = qc.check_eager_and_jit(lp, x, fmt, axis, **kw)
    return out[-1][1], r


def _wide_range(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-40, 40, shape))).astype(F32)


@pytest.mark.parametrize("shape, axis", [((4, 300), -1), ((300, 5), 0), ((2, 3, 128), -1), ((130,), 0)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_1x128_blocks_match_the_oracle(shape, axis, dtype):
    x = _wide_range(shape, 0).astype(dtype)
    q, _ = _checked(x, axis)
    blocks = -(-shape[axis] // 128)
    assert q.scale.shape == tuple(blocks if a == axis % len(shape) else n for a, n in enumerate(shape))


@pytest.mark.parametrize("shape", [(256, 384), (130, 300), (2, 129, 128)])
def test_128x128_tiles_match_the_oracle(shape):
    q, _ = _checked(_wide_range(shape, 1), block_2d=True)
    assert q.block_2d and q.scale.shape == shape[:-2] + (-(-shape[-2] // 128), -(-shape[-1] // 128))


def test_a_tile_has_one_scale_and_its_transpose_the_same_codes():
    """The weight's dgrad copy is the transpose of the same codes and scales."""
    w = _wide_range((256, 384), 2)
    q = lp.quantize(jnp.asarray(w), "fp8_block", block_2d=True)
    qt = lp.quantize(jnp.asarray(w.T), "fp8_block", block_2d=True)
    np.testing.assert_array_equal(qc.codes(q.data).T, qc.codes(qt.data))
    np.testing.assert_array_equal(np.asarray(q.scale).T, np.asarray(qt.scale))


def test_scales_are_powers_of_two_putting_the_amax_in_224_to_448():
    x = _wide_range((64, 1024), 3)
    q = lp.quantize(jnp.asarray(x), "fp8_block")
    inv = np.asarray(q.scale)
    assert not (inv.view(np.uint32) & 0x7FFFFF).any()  # exponent bits only
    amax = np.abs(x).reshape(64, 8, 128).max(-1)
    scaled = amax / inv
    assert ((scaled > 224) & (scaled <= 448)).all()


def test_worked_examples():
    # amax 1: 448 / 1 = 448 -> 256 (exponent bits kept), scale_inv 2^-8; 1 * 256 = 256 exactly.
    x = np.zeros((1, 128), F32)
    x[0, 0], x[0, 1], x[0, 2] = 1, -0.5, 1e-5
    q = lp.quantize(jnp.asarray(x), "fp8_block")
    assert np.asarray(q.scale)[0, 0] == F32(2.0**-8)
    # 1e-5 * 256 = 2.56e-3 rounds to E4M3's smallest subnormal, 2^-9 (the next is 2^-8)
    assert np.asarray(q.data.astype(jnp.float32))[0, :3].tolist() == [256.0, -128.0, 2.0**-9]
    # amax 448.5: 448 / 448.5 < 1 -> 0.5; 448.5 * 0.5 = 224.25 -> 224.
    x[0, 0] = 448.5
    q = lp.quantize(jnp.asarray(x), "fp8_block")
    assert np.asarray(q.scale)[0, 0] == 2 and float(q.data[0, 0].astype(jnp.float32)) == 224


def test_zero_nan_inf_and_negative_zero_blocks():
    x = np.random.default_rng(4).standard_normal((5, 256)).astype(F32)
    x[0, :128] = 0  # a zero block: scale 1, codes 0
    x[1, 3], x[1, 4] = np.nan, -np.nan  # NaN ignored by the amax; coded 0x7F whatever its sign
    x[2, 7] = np.inf  # an infinite amax: scale 1; inf saturates to 448
    x[3, 9] = -np.inf
    x[4, :128] = -0.0
    q, r = _checked(x)
    codes, inv = qc.codes(q.data), np.asarray(q.scale)
    assert inv[0, 0] == 1 and not codes[0, :128].any()
    assert codes[1, 3] == codes[1, 4] == 0x7F
    finite = np.where(np.isnan(x[1, :128]), 0, np.abs(x[1, :128]))
    assert inv[1, 0] == r.scale[1, 0] and 224 < finite.max() / inv[1, 0] <= 448  # the rest's amax
    assert inv[2, 0] == 1 and codes[2, 7] == 0x7E and codes[3, 9] == 0xFE  # +-448
    assert inv[4, 0] == 1 and (codes[4, :128] == 0x80).all()  # -0 stays -0


@pytest.mark.parametrize("shape, axis, block_2d", [((4, 300), -1, False), ((300, 5), 0, False),
                                                   ((130, 300), -1, True)])
def test_e5m2_blocks_match_the_oracle(shape, axis, block_2d):
    """fp8_block_e5m2 (the gradients of fp8_format HYBRID): the same blocks and power-of-two
    scales from 57344 / amax, so the block's largest magnitude lands in (28672, 57344]."""
    x = _wide_range(shape, 6)
    q, _ = _checked(x, axis, "fp8_block_e5m2", block_2d=block_2d)
    assert q.data.dtype == jnp.float8_e5m2 and q.fmt == "fp8_block_e5m2"
    _checked(x.astype(ml_dtypes.bfloat16), axis, "fp8_block_e5m2", block_2d=block_2d)
    if not block_2d:
        inv = np.moveaxis(np.asarray(q.scale), axis, -1)
        blocks = np.abs(np.moveaxis(x, axis, -1))
        amax = np.stack([blocks[..., i:i + 128].max(-1) for i in range(0, blocks.shape[-1], 128)], -1)
        assert ((amax / inv > 28672) & (amax / inv <= 57344)).all()


def test_e5m2_zero_nan_inf_and_subnormal_blocks():
    x = np.random.default_rng(5).standard_normal((4, 256)).astype(F32)
    x[0, :128] = 0
    x[1, 3] = np.nan
    x[2, 7], x[2, 200] = np.inf, -np.inf  # saturate to +-57344 with scale 1
    x[3, :128] = 0
    x[3, :4] = [1e-39, -2e-39, 5e-40, 1e-45]  # a subnormal block: scale 2^127
    q, _ = _checked(x, fmt="fp8_block_e5m2")
    codes, inv = qc.codes(q.data), np.asarray(q.scale)
    assert inv[0, 0] == 1 and not codes[0, :128].any()
    assert np.isnan(np.asarray(q.data.astype(jnp.float32))[1, 3])
    assert inv[2, 0] == inv[2, 1] == 1 and codes[2, 7] == 0x7B and codes[2, 200] == 0xFB  # +-57344
    # 2^-149 x 2^127 = 2^-22 is below E5M2's smallest subnormal, 2^-16; the others are not
    assert inv.view(np.uint32)[3, 0] == 0x00400000 and codes[3, :3].all() and codes[3, 3] == 0


def test_subnormal_blocks_are_not_flushed():
    """A block whose amax is a float32 subnormal takes the largest scale, 2^127 (scale_inv
    2^-127, itself subnormal), and its elements are scaled exactly: FP8 block scaling has
    no flush to zero, even on CPU, where XLA flushes subnormal operands."""
    x = np.zeros((2, 128), F32)
    x[0, :4] = [1e-39, -2e-39, 5e-40, 1e-45]
    x[1, 0], x[1, 1] = F32(1e-37), F32(-3e-39)  # a normal amax with a subnormal beside it
    q, r = _checked(x)
    inv = np.asarray(q.scale)
    assert inv.view(np.uint32)[0, 0] == 0x00400000  # 2^-127
    assert qc.codes(q.data)[0, :3].all() and qc.codes(q.data)[1, 1]  # not flushed to zero


def test_ragged_edges_are_zero_filled():
    x = _wide_range((3, 129), 5)
    padded = np.zeros((3, 256), F32)
    padded[:, :129] = x
    q, qp = (lp.quantize(jnp.asarray(a), "fp8_block") for a in (x, padded))
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(qp.scale))
    np.testing.assert_array_equal(qc.codes(q.data), qc.codes(qp.data)[:, :129])


def test_arguments_it_does_not_take():
    with pytest.raises(ValueError, match="block_2d=True needs at least 2 axes"):
        lp.quantize(jnp.ones(128), "fp8_block", block_2d=True)
    with pytest.raises(ValueError, match="rounding='stochastic' is only defined for fmt='nvfp4'"):
        lp.quantize(jnp.ones((2, 128)), "fp8_block", rounding="stochastic")
    with pytest.raises(ValueError, match="at least one axis"):
        lp.quantize(jnp.float32(1), "fp8_block")
    with pytest.raises(ValueError, match="no Pallas quantization kernel; use impl='xla'"):
        lp.quantize(jnp.ones((2, 128)), "fp8_block", impl="pallas")
