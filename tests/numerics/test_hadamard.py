"""lp.hadamard, the 16-point random Hadamard transform (docs/numerics.md, "Random Hadamard
transform (RHT)").

H = (1/4) diag(s) H16, built in FP32 and cast to BF16; each 16-element tile v along M
becomes v @ H, output rounded to BF16. The oracle forms v @ H exactly and rounds once.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import lp_jax as lp
from tests.support import numpy_reference as ref

H = ref.hadamard_matrix()


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def test_unit_vectors_give_the_rows_of_h_exactly():
    eye = jnp.eye(16, dtype=jnp.float32)
    out = lp.hadamard(eye, axis=-1)
    assert out.dtype == jnp.bfloat16 and out.shape == (16, 16)
    np.testing.assert_array_equal(_f32(out), H)  # e_i @ H = row i
    np.testing.assert_array_equal(_f32(lp.hadamard(eye, axis=0)), H.T)  # columns transformed


def test_is_orthogonal():
    h = _f32(lp.hadamard(jnp.eye(16, dtype=jnp.bfloat16)))
    np.testing.assert_array_equal(h @ h.T, np.eye(16, dtype=np.float32))  # entries ±1/4: exact
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    norms_in = np.linalg.norm(x.reshape(64, 2, 16), axis=-1)
    norms_out = np.linalg.norm(_f32(lp.hadamard(jnp.asarray(x))).reshape(64, 2, 16), axis=-1)
    np.testing.assert_allclose(norms_out, norms_in, rtol=2.0**-8)  # tile norms kept to bf16 rounding


@pytest.mark.parametrize("shape,axis", [((64,), -1), ((3, 32), -1), ((48, 5), 0), ((2, 32, 3), 1),
                                        ((2, 2, 3, 16), -1)])
def test_equals_the_oracle_bit_for_bit_on_exact_sums(shape, axis):
    # Small integers x 2^-3 in bf16: every tile sum is exact in FP32, so there is a single
    # correct BF16 result whatever the summation order.
    x = (np.random.default_rng(1).integers(-64, 65, shape) / 8).astype(ml_dtypes.bfloat16)
    out = lp.hadamard(jnp.asarray(x), axis=axis)
    assert out.dtype == jnp.bfloat16 and out.shape == shape
    np.testing.assert_array_equal(_f32(out), ref.hadamard(x, axis))


def test_close_to_the_oracle_on_general_fp32_inputs():
    # General FP32 inputs: the summation order is not specified, so allow one BF16 ulp of the
    # result plus the rounding of the terms (2^-8 of sum |v_i|/4).
    x = (np.random.default_rng(2).standard_normal((8, 64)) * 10.0 ** np.random.default_rng(3).uniform(-3, 3, (8, 64))
         ).astype(np.float32)
    got = _f32(lp.hadamard(jnp.asarray(x)))
    want = ref.hadamard(x)
    terms = np.abs(x.reshape(8, 4, 16)) @ np.abs(H)
    tol = np.abs(want) * 2.0**-7 + terms.reshape(8, 64) * 2.0**-8
    assert (np.abs(got - want) <= tol).all()
    assert (got == want).mean() > 0.99  # in practice all equal


def test_both_operands_along_the_shared_axis_preserve_the_product():
    # y = a @ b over the shared axis m: a [p, m] transformed along its last axis, b [m, q]
    # along its first: (a H)(Hᵀ b) = a b, up to the BF16 rounding of the two RHT outputs.
    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    b = rng.standard_normal((64, 12)).astype(np.float32)
    ah, bh = _f32(lp.hadamard(jnp.asarray(a), axis=-1)), _f32(lp.hadamard(jnp.asarray(b), axis=0))
    tol = 2 * 2.0**-8 * (np.abs(ah) @ np.abs(bh)) + 1e-5
    assert (np.abs(ah @ bh - a @ b) <= tol).all()
    assert not np.allclose(ah, a, atol=0.1)  # and the transform did change the operands


def test_jit_and_eager_agree():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 48)).astype(np.float32))
    np.testing.assert_array_equal(_f32(jax.jit(lp.hadamard, static_argnames="axis")(x, axis=-1)),
                                  _f32(lp.hadamard(x)))


def test_length_not_a_multiple_of_16_is_an_error_or_exact_zero_padding():
    # M must be a multiple of 16 for the RHT: a clear error otherwise, or zero padding, which
    # is exact. Either is allowed, nothing else (lp.hadamard raises; the GEMM pads).
    x = np.random.default_rng(6).integers(-8, 9, (3, 24)).astype(np.float32)
    try:
        out = lp.hadamard(jnp.asarray(x))
    except ValueError as e:
        assert "16" in str(e), str(e)
        return
    padded = np.pad(x, [(0, 0), (0, 8)])
    np.testing.assert_array_equal(_f32(out), ref.hadamard(padded))


def test_rht_parts_gives_the_transform_along_a_leading_axis_bit_for_bit():
    """The Pallas kernels' elementwise form (16 strided views in, 16 out) is the XLA path's
    transform along a non-minor axis, bits included (general bf16 inputs, not exact sums)."""
    from lp_jax.numerics.hadamard import rht_parts
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 24)) * 100, jnp.bfloat16)
    blocks = x.astype(jnp.float32).reshape(2, 16, 24)
    got = jnp.stack(rht_parts([blocks[:, k, :] for k in range(16)]), axis=1).reshape(32, 24)
    want = lp.hadamard(x, axis=0)
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    with pytest.raises(ValueError, match="^rht_parts takes 16 arrays, got 15$"):
        rht_parts([blocks[:, 0, :]] * 15)


@pytest.mark.parametrize("shape,axis", [((64, 24), 0), ((3, 32, 5), 1)])
def test_fused_butterfly_is_bit_identical_to_the_kernel_form(shape, axis):
    # The XLA path pairs elements through lax.rev, Pallas kernels apply rht_parts to 16
    # views: the same float32 operations in the same order, so the same bits even where the
    # FP32 sums round (values spread over 2^-40..2^40, so many do).
    from lp_jax.numerics.hadamard import rht_parts
    rng = np.random.default_rng(4)
    x = jnp.asarray((rng.standard_normal(shape) * 2.0 ** rng.integers(-40, 40, shape)).astype(np.float32))
    fused = lp.hadamard(x, axis=axis)
    tiles = x.reshape(shape[:axis] + (shape[axis] // 16, 16) + shape[axis + 1:])
    parts = rht_parts([lax.index_in_dim(tiles, k, axis + 1, keepdims=False) for k in range(16)])
    kernel_form = jnp.stack(parts, axis=axis + 1).reshape(shape)
    np.testing.assert_array_equal(np.asarray(fused).view(np.uint16), np.asarray(kernel_form).view(np.uint16))
