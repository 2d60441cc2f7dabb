"""Hopper's FP8 block-scaled GEMM (``lp_jax.kernels.fp8_block_gemm``, backend "wgmma").

Off the GPU the kernel runs in Pallas's GPU interpreter, which carries out its TMA copies,
its WGMMA (as a NumPy matmul of the E4M3 bytes in FP32) and its FP32 scaling: the values are
checked there against an FP64 product of the dequantized operands, and through
``lp.dot_general`` against the reference backend in fprop, dgrad and wgrad. The interpreter
runs a WGMMA to completion when issued (it has no asynchronous WGMMA and ``wgmma_wait`` does
nothing), so the ordering of the WGMMA and its wait is checked by lowering for CUDA (Mosaic
GPU lowers on the host) and, with JAX's CUDA plugin, compiling for sm_90a
(tests/plan/test_plan_compile.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from bench.backend_check import inputs, linear_vjp_fn, rel_err
from lp_jax.gemm import backends
from lp_jax.gemm.cuda_target import cuda_target
from lp_jax.kernels.fp8_block_gemm import K_BLOCK, fp8_block_gemm
from lp_jax.kernels.launch import compiled_kernels

E4M3 = jnp.float8_e4m3fn


def _operands(m, n, k, seed=0, exponents=(-8, 8)):
    rng = np.random.default_rng(seed)
    kb = -(-k // K_BLOCK)
    a = jnp.asarray(rng.normal(size=(m, k)) * 20, E4M3)
    b = jnp.asarray(rng.normal(size=(n, k)) * 20, E4M3)
    sa = jnp.asarray(2.0 ** rng.integers(*exponents, size=(m, kb)), jnp.float32)
    sb = jnp.asarray(2.0 ** rng.integers(*exponents, size=(n, kb)), jnp.float32)
    return a, sa, b, sb


def _dequantized(q, s):
    k = q.shape[1]
    return np.asarray(q.astype(jnp.float32), np.float64) * np.repeat(np.asarray(s, np.float64), K_BLOCK, 1)[:, :k]


@pytest.mark.parametrize("m,n,k", [(64, 128, 128), (100, 200, 300), (130, 256, 512)],
                         ids=["one-tile", "ragged", "tiles-and-k-blocks"])
def test_equals_the_dequantized_product_to_fp32_summation_order(m, n, k):
    a, sa, b, sb = _operands(m, n, k)
    got = np.asarray(jax.jit(fp8_block_gemm)(a, sa, b, sb))
    A, B = _dequantized(a, sa), _dequantized(b, sb)
    assert got.shape == (m, n) and got.dtype == np.float32
    bound = np.abs(A) @ np.abs(B).T  # FP32 summation error scales with the sum of |products|
    err = np.abs(got - A @ B.T) / bound
    assert err.max() <= 2e-7, err.max()  # about one FP32 ulp: only the order of the sum differs
    # ... and it is not the undeflated product (the scales were applied per K block)
    plain = np.asarray(a.astype(jnp.float32), np.float64) @ np.asarray(b.astype(jnp.float32), np.float64).T
    assert np.abs(got - plain).max() > 1.0


def test_the_smallest_scale_is_not_flushed():
    """2^-127, the least scale FP8 block scaling makes (an FP32 subnormal), against 2^30:
    partial x 2^-127 x 2^30 is a normal number, so a flushed subnormal would show. Operands
    of at least 1 (no cancellation): every partial x 2^-127 is normal too."""
    a, _, b, _ = _operands(64, 128, 256, seed=1)
    a, b = (jnp.abs(t.astype(jnp.float32)).clip(1, 448).astype(E4M3) for t in (a, b))
    sa = jnp.full((64, 2), 2.0 ** -127, jnp.float32)
    sb = jnp.full((128, 2), 2.0 ** 30, jnp.float32)
    got = np.asarray(jax.jit(fp8_block_gemm)(a, sa, b, sb))
    A, B = _dequantized(a, sa), _dequantized(b, sb)
    assert (np.abs(got - A @ B.T) / (np.abs(A) @ np.abs(B).T)).max() <= 2e-7


def test_zero_blocks_give_zeros():
    a, sa, b, sb = _operands(64, 128, 256, seed=2)
    a = a.at[:, :K_BLOCK].set(0)
    b = b.at[:, K_BLOCK:].set(0)
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8_block_gemm)(a, sa, b, sb)), 0)


def test_bad_operands_are_one_line():
    a, sa, b, sb = _operands(64, 128, 256)
    with pytest.raises(ValueError, match="E4M3 operands"):
        fp8_block_gemm(a.astype(jnp.bfloat16), sa, b, sb)
    with pytest.raises(ValueError, match="one scale per row per 128"):
        fp8_block_gemm(a, sa[:, :1], b, sb)


def test_dot_general_on_the_wgmma_backend_equals_the_reference():
    """fprop (1x128 x 128x128), dgrad (1x128 x 128x128) and wgrad (1x128 x 1x128) of a Linear
    with every edge ragged, FP32 activations."""
    args = inputs((3, 70, 300), 136)
    ref = jax.jit(linear_vjp_fn(lp.get_recipe("fp8_block", backend="reference")))(*args)
    recipe = lp.get_recipe("fp8_block", backend="wgmma")
    got = jax.jit(linear_vjp_fn(recipe))(*args)
    for r, g, what in zip(ref, got, ("y", "dx", "dW")):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) <= 1e-6, (what, rel_err(g, r))
    text = str(jax.make_jaxpr(linear_vjp_fn(recipe))(*args))
    assert text.count("wgmma") >= 3  # three kernels, each with its WGMMA


def test_only_fp8_block_runs_on_wgmma():
    with pytest.raises(ValueError, match="backend='wgmma' cannot run recipe 'mxfp8'"):
        lp.get_recipe("mxfp8", backend="wgmma")
    assert lp.get_recipe("fp8_block").native_backends == ("cudnn", "wgmma")


def test_auto_picks_wgmma_on_hopper_and_cudnn_on_blackwell():
    recipe = lp.get_recipe("fp8_block")
    with cuda_target((9, 0)):
        assert backends.backend_on(recipe, "cuda") == "wgmma"
        assert backends.backend_on(lp.get_recipe("mxfp8"), "cuda") == "cudnn"
    with cuda_target((10, 0)):
        assert backends.backend_on(recipe, "cuda") == "cudnn"
    assert backends.backend_on(recipe, "cpu") == "reference"


def _lowered_for_cuda(recipe, capability):
    args = inputs((2, 64, 256), 128, jnp.bfloat16)
    with compiled_kernels(), cuda_target(capability):
        return jax.jit(linear_vjp_fn(recipe)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowered_for_hopper_auto_runs_three_mosaic_gpu_kernels():
    text = _lowered_for_cuda(lp.get_recipe("fp8_block"), (9, 0))
    assert text.count("mosaic_gpu") >= 3 and "block_scaled_dot" not in text
    blackwell = _lowered_for_cuda(lp.get_recipe("fp8_block"), (10, 0))
    assert "mosaic_gpu" not in blackwell and "block_scaled_dot" in blackwell


def test_forced_wgmma_for_blackwell_is_one_line():
    with pytest.raises(ValueError, match="backend 'wgmma' is Hopper's") as e:
        _lowered_for_cuda(lp.get_recipe("fp8_block", backend="wgmma"), (10, 0))
    assert "\n" not in str(e.value)


def test_a_partitioned_mesh_keeps_auto_on_cudnn_and_refuses_forced_wgmma():
    """The kernel has no partitioning rule: on a mesh that splits more than the batch, XLA
    would feed it whole operands."""
    import dataclasses

    from lp_jax.parallel.linear_layout import LinearLayout

    assert not LinearLayout({"data": 8, "fsdp": 1, "tensor": 1}).partitioned
    assert LinearLayout({"data": 1, "fsdp": 8, "tensor": 1}).partitioned
    assert LinearLayout({"data": 2, "fsdp": 1, "tensor": 4}).partitioned
    x, w = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    for partitioned, expected in ((False, "mosaic_gpu"), (True, "block_scaled_dot")):
        dg = dataclasses.replace(lp.dot_general("fp8_block"), partitioned=partitioned)
        with compiled_kernels(), cuda_target((9, 0)):
            text = jax.jit(lambda x, w: dg(x, w, dims)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert expected in text, partitioned
    from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral

    stacked = LayerPolicyDotGeneral(lp.get_recipe("fp8_block"), 4, partitioned=True)  # scanned layers
    with compiled_kernels(), cuda_target((9, 0)):
        text = jax.jit(lambda x, w: stacked(x, w, dims)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in text and "block_scaled_dot" in text
    forced = dataclasses.replace(lp.dot_general(lp.get_recipe("fp8_block", backend="wgmma")), partitioned=True)
    with pytest.raises(ValueError, match="backend 'wgmma' has no partitioning rule"):
        forced(x, w, dims)
