"""The JAX APIs the GPU work uses exist and work on this JAX (CI runs this file on the oldest
supported JAX, 0.11.2, and on the newest); names that came later fail in one clear line."""
import pathlib
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax import jax_compat
from lp_jax.jax_compat import JaxVersionError, jax_api, mosaic_gpu

CPU = jax.devices("cpu")[0]  # the interpreter and CPU values, also where a GPU is the default

GPU_APIS = [
    "jax.nn.scaled_matmul",
    "jax.lax.platform_dependent",
    "jax.experimental.pallas.pallas_call",
    *(f"jax.experimental.pallas.mosaic_gpu.{n}" for n in (
        "CompilerParams", "InterpretGPUParams", "kernel", "SMEM", "Barrier", "copy_gmem_to_smem",
        "copy_smem_to_gmem", "barrier_wait", "commit_smem", "wait_smem_to_gmem")),
]


@pytest.mark.parametrize("path", GPU_APIS)
def test_gpu_api_exists(path):
    assert callable(jax_api(path))


def test_installed_jax_is_supported():
    oldest = tuple(int(p) for p in jax_compat.OLDEST_JAX.split("."))
    assert jax.__version_info__ >= oldest, jax.__version__


def test_one_oldest_jax_in_pyproject_ci_and_jax_compat():
    root = pathlib.Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(line.split("==") for line in (root / ".ci" / "oldest-jax.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert f"jax>={jax_compat.OLDEST_JAX}" in deps
    assert pins == {"jax": jax_compat.OLDEST_JAX, "jaxlib": jax_compat.OLDEST_JAX}


@pytest.mark.parametrize("name", jax_compat.MOSAIC_GPU_SINCE_0_12)
def test_mosaic_gpu_names_from_0_12_say_so_on_older_jax(name):
    # Keeps the table honest both ways: present from 0.12 on, a one-line error before.
    if jax.__version_info__ >= (0, 12):
        assert mosaic_gpu(name) is not None
    else:
        with pytest.raises(JaxVersionError) as info:
            mosaic_gpu(name)
        assert str(info.value) == (f"jax.experimental.pallas.mosaic_gpu.{name} needs JAX >= 0.12; "
                                   f"this is JAX {jax.__version__}")


def test_unknown_name_is_one_line_not_an_attribute_error():
    with pytest.raises(JaxVersionError) as info:
        jax_api("jax.nn.no_such_function")
    assert str(info.value) == f"jax.nn.no_such_function is not in this JAX; this is JAX {jax.__version__}"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_mosaic_gpu_kernel_runs_in_the_cpu_interpreter():
    # A Mosaic GPU kernel in its own terms: GMEM refs, a TMA copy into SMEM behind a
    # barrier, SMEM arithmetic, a copy back. InterpretGPUParams runs it on CPU.
    x = jnp.arange(128 * 64, dtype=jnp.float32).reshape(128, 64)

    def body(x_gmem, o_gmem):
        def scoped(smem, barrier):
            plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)
            plgpu.barrier_wait(barrier)
            smem[...] = smem[...] * 2.0 + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(scoped, plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1))

    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with jax.default_device(CPU):
        out = plgpu.kernel(body, out_type=out_type, interpret=plgpu.InterpretGPUParams())(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2 + 1)
    # The same kernel lowers for CUDA here (no GPU needed) to a Mosaic GPU custom call.
    text = jax.jit(plgpu.kernel(body, out_type=out_type)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_pallas_call_with_mosaic_gpu_params_runs_in_the_cpu_interpreter():
    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
    with jax.default_device(CPU):
        out = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] - 3.0),
                             out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                             compiler_params=mosaic_gpu("CompilerParams")(),
                             interpret=mosaic_gpu("InterpretGPUParams")())(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) - 3)


def _mx_operands():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((1, 16, 64)), jnp.float8_e4m3fn)
    codes = lambda shape: jnp.asarray(rng.integers(120, 134, shape).astype(np.uint8))  # noqa: E731
    sa = jax.lax.bitcast_convert_type(codes((1, 32, 2)), jnp.float8_e8m0fnu)  # one scale per 32 along K
    sb = jax.lax.bitcast_convert_type(codes((1, 16, 2)), jnp.float8_e8m0fnu)
    return a, b, sa, sb


def _scaled_matmul(a, b, sa, sb):
    return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)


def test_scaled_matmul_lowers_to_cublas_block_scaled_dot_for_cuda():
    text = jax.jit(_scaled_matmul).trace(*_mx_operands()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__op$block_scaled_dot" in text


def test_scaled_matmul_on_cpu_is_the_dequantized_product():
    a, b, sa, sb = jax.device_put(_mx_operands(), CPU)
    got = np.asarray(jax.jit(_scaled_matmul)(a, b, sa, sb))
    # q * 2^(e - 127) per 32 along K, exact in float64, as are the products and their sums.
    deq = lambda q, s: (np.asarray(q.astype(jnp.float32), np.float64)  # noqa: E731
                        * np.repeat(np.asarray(s.astype(jnp.float32), np.float64), 32, axis=-1))
    want = np.einsum("bmk,bnk->bmn", deq(a, sa), deq(b, sb))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_platform_dependent_picks_the_branch_per_platform():
    f = lambda x: jax.lax.platform_dependent(x, cpu=lambda x: x * 3.0, cuda=lambda x: x * 5.0)  # noqa: E731
    assert float(jax.jit(f)(jax.device_put(jnp.float32(1), CPU))) == 3.0
    text = jax.jit(f).trace(jnp.float32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "5.0" in text and "3.0" not in text


def test_cudnn_attention_internals_the_model_and_plan_use():
    """models.cudnn_attention calls JAX's cuDNN attention for its packed layout (the public
    jax.nn.dot_product_attention has no segment offsets), and the plan answers its
    compute-capability check for the described GPU: both are private names, checked here on
    the oldest and newest JAX."""
    import inspect

    from jax._src.cudnn import fused_attention_stablehlo as fused

    params = inspect.signature(fused.dot_product_attention).parameters
    for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "qkv_layout", "scale"):
        assert name in params, name
    assert fused.MaskType.PADDING_CAUSAL and fused.MaskType.CAUSAL
    assert callable(fused.check_compute_capability) and callable(fused.is_cuda_compute_capability_equal)
