"""The tensor amax as a lane vector: every lane holds the whole tensor's amax (NaN included),
the NVFP4 kernels compute their tensor scale from it themselves, and nothing sits between the
amax's one reduction and the quantizer kernel (no pad of a float32 scalar, no second
reduction), which is what took the scalar kernels out of the NVFP4 layer (docs/plan.md)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax.kernels.amax import tensor_amax
from lp_jax.kernels.launch import SMEM_LANES, compiled_kernels
from lp_jax.kernels.pallas_nvfp4 import nvfp4_tiling
from lp_jax.kernels.tiles import pad
from lp_jax.numerics.quantize import abs_max, nvfp4_tensor_scale
from tests.support import numpy_reference as ref
from tests.support.pallas_checks import mixed


@pytest.mark.parametrize("nonfinite", [False, True])
def test_every_lane_is_the_tensor_amax(nonfinite):
    if nonfinite:
        x = mixed((136, 144), nonfinite=True).astype(jnp.bfloat16)  # 2 x 2 tiles of 128
    else:  # the max in the last of the 2 x 2 tiles, so each lane's max runs over the tiles
        x = jax.random.normal(jax.random.key(0), (136, 144), jnp.bfloat16).at[130, 140].set(-97.0)
    t = nvfp4_tiling((1, *x.shape))
    (amax,) = tensor_amax(pad(x[None], t), t, interpret=True)
    assert amax.shape == (SMEM_LANES,)
    want = np.asarray(abs_max(x))
    np.testing.assert_array_equal(np.asarray(amax), np.full(SMEM_LANES, want))


def test_nvfp4_tensor_scale_without_isfinite_is_the_references_bits():
    """Written with isnan | isinf (which Mosaic GPU lowers), S_enc keeps the contract's
    zero and non-finite rules: the NumPy reference's bits."""
    tiny = np.finfo(np.float32).tiny  # 2688 / tiny overflows: the FLT_MAX clamp (a subnormal
    # amax would be flushed to 0 on CPU, docs/numerics.md)
    amax = np.array([0.0, -0.0, tiny, 1e-30, 1.0, 448.0 * 6, 3e38, np.inf, -np.inf, np.nan, -1.0], np.float32)
    got = np.asarray(nvfp4_tensor_scale(jnp.asarray(amax))).view(np.uint32)
    want = np.array([ref.nvfp4_tensor_scales(a)[0] for a in amax], np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [1, 0])
def test_the_amax_reaches_the_kernel_without_a_scalar_pass(axis):
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)  # whole tiles: no ragged pad
    with compiled_kernels():
        text = jax.jit(lambda t: lp.quantize(t, "nvfp4", axis, impl="pallas")).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    reduces = re.findall(r"stablehlo\.reduce\(.*-> tensor<([^>]*)>", text)
    assert reduces == [f"{SMEM_LANES}xf32"], reduces  # one max over the tiles' partials, per lane
    pads = re.findall(r"stablehlo\.pad .*-> tensor<([^>]*)>", text)
    assert pads == [f"{SMEM_LANES}xui32"], pads  # the SR seeds' only; no float32 scalar padded
