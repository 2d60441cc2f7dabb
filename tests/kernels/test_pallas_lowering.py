"""The Pallas kernels that Mosaic GPU lowers for CUDA keep lowering (checked on the host, no
GPU needed): a change to a kernel's tile arithmetic that Mosaic GPU cannot lower fails here,
not first on a GPU machine. The kernels' bits are tested in the interpreter
(tests/kernels/test_pallas_quantize.py, test_pallas_dot_general.py); here only the lowering."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import lp_jax as lp
from lp_jax.gemm.operands import operand_pair
from lp_jax.kernels.launch import cuda_lowering_error
from lp_jax.recipes import OperandSpec

X = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_per_tensor_amax_and_cast_lower(fmt, dtype):
    x = jax.ShapeDtypeStruct((3, 40, 72), dtype)
    assert cuda_lowering_error(lambda t: lp.quantize(t, fmt, impl="pallas"), x) is None


@pytest.mark.parametrize("scale_rule,dtype", [("rceil", jnp.bfloat16), ("floor", jnp.bfloat16), ("rceil", jnp.float32)])
def test_mxfp8_rows_lower(scale_rule, dtype):
    x = jax.ShapeDtypeStruct((2, 64, 96), dtype)
    assert cuda_lowering_error(lambda t: lp.quantize(t, "mxfp8", scale_rule=scale_rule, impl="pallas"), x) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])  # float32: the column copy on strided views
def test_mxfp8_both_copies_lower(dtype):
    spec = OperandSpec("mxfp8", quantize_impl="pallas")
    key = jax.eval_shape(lambda: jax.random.key(0))
    pair = lambda t, k: operand_pair(t, spec, 1, spec, 0, k, k, keep_b=True)  # noqa: E731
    assert cuda_lowering_error(pair, jax.ShapeDtypeStruct(X.shape, dtype), key) is None


@pytest.mark.parametrize("axis,rounding,dtype", [(1, "nearest", jnp.bfloat16), (1, "stochastic", jnp.float32),
                                                  (0, "stochastic", jnp.bfloat16)])
def test_nvfp4_1x16_amax_and_copy_lower(axis, rounding, dtype):
    """The tensor amax, then the 1x16 copy: along the last axis (the row copy) or the first
    (the column copy, written transposed and swapped back by XLA)."""
    x = jax.ShapeDtypeStruct((72, 136), dtype)  # ragged: tiles of 64 and 128
    key = jax.eval_shape(lambda: jax.random.key(0))
    fn = lambda t, k: lp.quantize(t, "nvfp4", axis, rounding=rounding, key=k, impl="pallas")  # noqa: E731
    assert cuda_lowering_error(fn, x, key) is None


@pytest.mark.parametrize("rounding,dtype", [("nearest", jnp.float32), ("stochastic", jnp.bfloat16)])
def test_nvfp4_16x16_tiles_lower(rounding, dtype):
    x = jax.ShapeDtypeStruct((2, 40, 136), dtype)  # batched weights, ragged on both sides
    key = jax.eval_shape(lambda: jax.random.key(0))
    fn = lambda t, k: lp.quantize(t, "nvfp4", block_2d=True, rounding=rounding, key=k, impl="pallas")  # noqa: E731
    assert cuda_lowering_error(fn, x, key) is None


@pytest.mark.parametrize("row_sr", [False, True])
def test_nvfp4_wgrad_pair_with_rht_and_sr_lowers(row_sr):
    """x's and dy's copies in the dot_general: the row copy and the column copy after the
    16-point RHT along the tokens with stochastic rounding, each with its own tensor amax
    (the amax after the RHT from the same read), R not a multiple of 16 (the RHT pads)."""
    row = OperandSpec("nvfp4", stochastic=row_sr, quantize_impl="pallas")
    col = OperandSpec("nvfp4", stochastic=True, rht=True, quantize_impl="pallas")
    key = jax.eval_shape(lambda: jax.random.key(0))
    pair = lambda t, k: operand_pair(t, row, 1, col, 0, k, k, keep_b=True)  # noqa: E731
    assert cuda_lowering_error(pair, jax.ShapeDtypeStruct((40, 96), jnp.bfloat16), key) is None


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_along_a_middle_axis_lowers(rule):
    """The column copy in place (strided views of the tile, no transposed store)."""
    x = jax.ShapeDtypeStruct((3, 72, 40), jnp.float32)
    assert cuda_lowering_error(lambda t: lp.quantize(t, "mxfp8", 1, scale_rule=rule, impl="pallas"), x) is None


def test_a_kernel_mosaic_gpu_refuses_is_reported():
    """The check can fail: FP8's transposed copy (which the dot_general never asks for) does
    not lower yet (docs/backends.md)."""
    from lp_jax.kernels.pallas_fp8 import fp8_cast
    from lp_jax.kernels.tiles import tiling
    from lp_jax.numerics.formats import E4M3
    one = jnp.ones((1,), jnp.float32)
    x3 = jax.ShapeDtypeStruct((1, 64, 96), jnp.bfloat16)
    error = cuda_lowering_error(lambda t: fp8_cast(t, one, E4M3, tiling(t.shape), transposed=True), x3)
    assert error is not None and error.split(":")[0].endswith("Error")
