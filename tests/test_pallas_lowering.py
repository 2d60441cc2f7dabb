"""The Pallas kernels that Mosaic GPU lowers for CUDA keep lowering (checked on the host, no
GPU needed): a change to a kernel's tile arithmetic that Mosaic GPU cannot lower fails here,
not first on a GPU machine. The kernels' bits are tested in the interpreter
(tests/test_pallas_quantize.py, test_pallas_dot_general.py); here only the lowering."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import lp_jax as lp
from lp_jax.gemm.operands import operand_pair
from lp_jax.kernels.launch import cuda_lowering_error
from lp_jax.recipes import OperandSpec

X = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)  # ragged: padded to 64x96 tiles of 32-multiples


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_per_tensor_amax_and_cast_lower(fmt, dtype):
    x = jax.ShapeDtypeStruct((3, 40, 72), dtype)
    assert cuda_lowering_error(lambda t: lp.quantize(t, fmt, impl="pallas"), x) is None


@pytest.mark.parametrize("scale_rule,dtype", [("rceil", jnp.bfloat16), ("floor", jnp.bfloat16), ("rceil", jnp.float32)])
def test_mxfp8_rows_lower(scale_rule, dtype):
    x = jax.ShapeDtypeStruct((2, 64, 96), dtype)
    assert cuda_lowering_error(lambda t: lp.quantize(t, "mxfp8", scale_rule=scale_rule, impl="pallas"), x) is None


def test_mxfp8_both_copies_lower():  # bf16 only: float32's transposed load does not lower
    spec = OperandSpec("mxfp8", quantize_impl="pallas")
    key = jax.eval_shape(lambda: jax.random.key(0))
    pair = lambda t, k: operand_pair(t, spec, 1, spec, 0, k, k, keep_b=True)  # noqa: E731
    assert cuda_lowering_error(pair, X, key) is None


def test_a_kernel_mosaic_gpu_refuses_is_reported():
    """The check can fail: the NVFP4 1x16 kernel does not lower yet (docs/backends.md)."""
    error = cuda_lowering_error(lambda t: lp.quantize(t, "nvfp4", impl="pallas"), X)
    assert error is not None and error.split(":")[0].endswith("Error")
