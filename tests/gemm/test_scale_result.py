"""The tensor factors on a GEMM's FP32 result (NVFP4's S_dec): ``formats.mul``'s exact steps
where the program is lowered for CPU, plain multiplies in the same order for CUDA."""
import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.gemm.operands import apply_factors, scale_result
from lp_jax.numerics import formats as F


def _lowered(platform, *factors):
    out = jax.ShapeDtypeStruct((64, 48), jnp.float32)
    scalars = [jax.ShapeDtypeStruct((), jnp.float32)] * len(factors)
    return jax.jit(scale_result).trace(out, *scalars).lower(lowering_platforms=(platform,)).as_text()


def test_lowered_for_cuda_the_factors_are_two_multiplies_of_the_result():
    cuda, cpu = _lowered("cuda", 1, 1), _lowered("cpu", 1, 1)
    assert cuda.count("stablehlo.multiply") == 2, cuda
    for op in ("bitcast_convert", "select", "compare"):
        assert op not in cuda, op
        assert op in cpu, op


def test_without_factors_the_result_is_untouched():
    out = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    assert scale_result(out, None, None) is out


def test_on_cpu_it_is_the_references_rounding_even_for_a_subnormal_factor():
    rng = np.random.default_rng(0)
    out = jnp.asarray(rng.standard_normal((32, 16)) * 1e3, jnp.float32)
    subnormal = F.recip(jnp.float32(2.0**127))  # 2^-127, a float32 subnormal
    for fa, fb in ((jnp.float32(3e-3), jnp.float32(0.7)), (subnormal, jnp.float32(2.0**100))):
        got = jax.jit(scale_result)(out, fa, fb)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(apply_factors(out, fa, fb)))
    # CPU flushes a plain multiply by the subnormal factor to zero; the lowered path does not.
    assert np.all(np.asarray(jax.jit(scale_result)(out, subnormal, jnp.float32(2.0**100))) != 0)
