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
from lp_jax.numerics import formats as F
from lp_jax.numerics.quantize import NVFP4_TENSOR_SCALE_NUM, abs_max, nvfp4_tensor_scale
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


def _scale_with_isfinite(amax):
    amax = amax.astype(jnp.float32)
    s_enc = jnp.minimum(jnp.float32(NVFP4_TENSOR_SCALE_NUM) / amax, jnp.float32(F.FLT_MAX))
    bad = (amax == 0) | ~jnp.isfinite(amax) | (s_enc == 0)
    return jnp.where(bad, jnp.float32(1), s_enc)


def test_nvfp4_tensor_scale_without_isfinite_is_the_same_bits():
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    amax = jnp.array([0.0, -0.0, tiny, 1e-30, 1.0, 448.0 * 6, 3e38, np.inf, -np.inf, np.nan, -1.0], jnp.float32)
    got = np.asarray(nvfp4_tensor_scale(amax)).view(np.uint32)
    np.testing.assert_array_equal(got, np.asarray(_scale_with_isfinite(amax)).view(np.uint32))


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
