"""lp.quantize(impl="pallas") gives lp.quantize(impl="xla")'s bits: FP8 per tensor and MXFP8
along each axis, on ragged shapes and special values (Pallas GPU interpreter on CPU; NVFP4 in
tests/kernels/test_pallas_nvfp4.py).

The XLA path is itself checked against the NumPy oracle (tests/numerics/test_quantize_*.py), so equal
bits here make the kernels correct by the same standard. Shapes are small: the interpreter
runs each tile as a sequence of host callbacks."""
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from tests.support.pallas_checks import both_impls as _both
from tests.support.pallas_checks import mixed


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_per_tensor(fmt):
    _both(mixed((40, 72)), fmt)  # ragged: neither side a multiple of the 32-element tile
    _both(mixed((3, 40, 24), nonfinite=True).astype(jnp.bfloat16), fmt)  # NaN amax: scale 1
    _both(jnp.zeros((5,), jnp.float32), fmt)  # all zeros: scale 1
    _both(jnp.float32(3.5), fmt)  # a scalar


@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
def test_mxfp8_along_each_axis(scale_rule):
    x = mixed((40, 72), nonfinite=True)  # NaN and inf blocks: codes 255 and 254
    _both(x, "mxfp8", axis=1, scale_rule=scale_rule)
    _both(x, "mxfp8", axis=0, scale_rule=scale_rule)
    _both(mixed((3, 40, 24)).astype(jnp.bfloat16), "mxfp8", axis=1, scale_rule=scale_rule)  # middle axis


def test_impl_is_checked_and_auto_is_xla_off_the_gpu():
    from lp_jax import quantizer
    with pytest.raises(ValueError, match=r"^impl='triton' is not valid; expected one of \('xla', 'pallas', 'auto'\)$"):
        lp.quantize(jnp.ones((4, 32)), "mxfp8", impl="triton")
    assert [quantizer.resolve_impl("auto", f) for f in ("mxfp8", "nvfp4", "fp8_e4m3")] == ["xla"] * 3


def test_auto_runs_the_kernels_for_mxfp8_and_nvfp4_traced_for_a_blackwell_gpu():
    from lp_jax import quantizer
    from lp_jax.kernels.cuda_target import cuda_target
    from lp_jax.kernels.launch import compiled_kernels

    auto = lambda fmt, **kw: quantizer.resolve_impl("auto", fmt, **kw)  # noqa: E731
    for capability in ((10, 0), (12, 0)):
        with compiled_kernels(), cuda_target(capability):
            assert (auto("mxfp8"), auto("nvfp4")) == ("pallas", "pallas")
            # FP8-CS's kernels launch more (docs/plan.md); FP8 block and 4/6 have none; a
            # shard's given tensor amax is XLA's to use.
            assert (auto("fp8_e4m3"), auto("fp8_block"), auto("nvfp4", block_scale_search="4over6"),
                    auto("nvfp4", tensor_amax=jnp.float32(1))) == ("xla",) * 4
            assert quantizer.resolve_impl("xla", "mxfp8") == "xla"
    for capability in ((8, 0), (9, 0)):  # Hopper was not measured (its GEMMs are XLA's there)
        with compiled_kernels(), cuda_target(capability):
            assert (auto("mxfp8"), auto("nvfp4")) == ("xla", "xla")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_nan_block_gets_the_nan_code_next_to_inf(impl):
    # XLA:CPU's float max reduction dropped these NaNs (codes 254 and 122 came out) before
    # quantize.abs_max took the max over the bits of |x|; the contract says code 255.
    x = np.zeros((64, 96), np.float32)
    x[39, :3] = [np.nan, np.inf, -np.inf]
    x[40, 0], x[40, 1:32] = np.nan, 2.5
    codes = np.asarray(lp.quantize(jnp.asarray(x), "mxfp8", impl=impl).scale).view(np.uint8)
    assert codes[39, 0] == 255 and codes[40, 0] == 255 and codes[41, 0] == 0
