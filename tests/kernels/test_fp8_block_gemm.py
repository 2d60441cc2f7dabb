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
from lp_jax.kernels.cuda_target import cuda_target
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


@pytest.mark.parametrize("e5m2", ["a", "b"])
def test_e5m2_operands_mixed_with_e4m3(e5m2):
    """fp8_format HYBRID's gradients: dy in E5M2 against x or W in E4M3 (WGMMA takes the pair)."""
    a, sa, b, sb = _operands(100, 200, 300, seed=3)
    if e5m2 == "a":
        a = (a.astype(jnp.float32) * 64).astype(jnp.float8_e5m2)
    else:
        b = (b.astype(jnp.float32) * 64).astype(jnp.float8_e5m2)
    got = np.asarray(jax.jit(fp8_block_gemm)(a, sa, b, sb))
    A, B = _dequantized(a, sa), _dequantized(b, sb)
    assert (np.abs(got - A @ B.T) / (np.abs(A) @ np.abs(B).T)).max() <= 2e-7


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
    with pytest.raises(ValueError, match="E4M3 or E5M2 operands"):
        fp8_block_gemm(a.astype(jnp.bfloat16), sa, b, sb)
    with pytest.raises(ValueError, match="one scale per row per 128"):
        fp8_block_gemm(a, sa[:, :1], b, sb)


@pytest.mark.parametrize("name", ["fp8_block", "bf16_with_fp8_subchannel_scaling_mixed"])
def test_dot_general_on_the_wgmma_backend_equals_the_reference(name):
    """fprop (1x128 x 128x128), dgrad (1x128 x 128x128) and wgrad (1x128 x 1x128) of a Linear
    with every edge ragged, FP32 activations; Bridge's recipe with E5M2 gradients too."""
    args = inputs((3, 70, 300), 136)
    ref = jax.jit(linear_vjp_fn(lp.get_recipe(name, backend="reference")))(*args)
    recipe = lp.get_recipe(name, backend="wgmma")
    got = jax.jit(linear_vjp_fn(recipe))(*args)
    for r, g, what in zip(ref, got, ("y", "dx", "dW")):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) <= 1e-6, (what, rel_err(g, r))
    if jax.default_backend() == "gpu":  # bench/gpu_check.sh: the compiled kernel, partitioned
        text = jax.jit(linear_vjp_fn(recipe)).lower(*args).compile().as_text()
        assert text.count('custom_call_target="mosaic_gpu') >= 3
    else:  # interpreted: three kernels, each with its WGMMA
        assert str(jax.make_jaxpr(linear_vjp_fn(recipe))(*args)).count("wgmma") >= 3


def test_only_fp8_block_runs_on_wgmma():
    with pytest.raises(ValueError, match="backend='wgmma' cannot run recipe 'mxfp8'"):
        lp.get_recipe("mxfp8", backend="wgmma")
    assert lp.get_recipe("fp8_block").native_backends == ("cudnn", "wgmma", "xla_scaled_dot")


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


@pytest.mark.parametrize("name", ["fp8_block", "bf16_with_fp8_subchannel_scaling_mixed"])
def test_lowered_for_hopper_auto_runs_three_mosaic_gpu_kernels(name):
    text = _lowered_for_cuda(lp.get_recipe(name), (9, 0))
    assert text.count("mosaic_gpu") >= 3 and "block_scaled_dot" not in text
    blackwell = _lowered_for_cuda(lp.get_recipe(name), (10, 0))
    assert "mosaic_gpu" not in blackwell and "block_scaled_dot" in blackwell


def test_forced_wgmma_for_blackwell_is_one_line():
    with pytest.raises(ValueError, match="backend 'wgmma' is Hopper's") as e:
        _lowered_for_cuda(lp.get_recipe("fp8_block", backend="wgmma"), (10, 0))
    assert "\n" not in str(e.value)


def test_a_partly_manual_mesh_keeps_auto_on_cudnn_and_refuses_forced_wgmma():
    """Inside the trainer's data shard_map manual over data > 1 with fsdp or tensor > 1 left
    to the partitioner, JAX's custom partitioners do not compile."""
    import dataclasses

    from lp_jax.parallel.linear_layout import LinearLayout
    from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral

    assert not LinearLayout({"data": 8, "fsdp": 1, "tensor": 1}).partly_manual  # ZeRO-1: all manual
    assert not LinearLayout({"data": 1, "fsdp": 8, "tensor": 1}).partly_manual  # ZeRO-3: all auto
    assert LinearLayout({"data": 2, "fsdp": 1, "tensor": 4}).partly_manual
    assert LinearLayout({"data": 2, "fsdp": 4, "tensor": 1}).partly_manual
    x, w = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    plain = lp.dot_general("fp8_block")
    cases = ((plain, "mosaic_gpu"), (dataclasses.replace(plain, partly_manual=True), "block_scaled_dot"),
             (LayerPolicyDotGeneral(lp.get_recipe("fp8_block"), 4, partly_manual=True), "block_scaled_dot"))
    for dg, expected in cases:
        with compiled_kernels(), cuda_target((9, 0)):
            text = jax.jit(lambda x, w: dg(x, w, dims)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert expected in text and ("mosaic_gpu" in text) == (expected == "mosaic_gpu"), dg
    forced = dataclasses.replace(lp.dot_general(lp.get_recipe("fp8_block", backend="wgmma")), partly_manual=True)
    with pytest.raises(ValueError, match="backend 'wgmma' does not compile on a mesh with data > 1") as e:
        forced(x, w, dims)
    assert "\n" not in str(e.value)


PARTITIONED = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from lp_jax.gemm.wgmma_partitioning import partitioned

def local(a, sa, b, sb):  # the kernel's arithmetic in XLA (the interpreter cannot run here)
    deq = lambda q, s: q.astype(jnp.float32) * jnp.repeat(s, 128, 1)[:, :q.shape[1]]
    return deq(a, sa) @ deq(b, sb).T

rng = np.random.default_rng(0)
a, b = (jnp.asarray(rng.normal(size=(rows, 384)) * 10, jnp.float8_e4m3fn) for rows in (256, 320))
sa, sb = (jnp.asarray(2.0 ** rng.integers(-8, 8, size=(rows, 3)), jnp.float32) for rows in (256, 320))
want = np.asarray(local(a, sa, b, sb))
mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
gemm = jax.jit(partitioned(local))
for rows_a, rows_b in ((("fsdp", None), ("tensor", "fsdp")), (("fsdp", None), ("fsdp", None)),
                       ((None, "fsdp"), ("tensor", None))):
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    args = (put(a, rows_a), put(sa, (rows_a[0], None)), put(b, rows_b), put(sb, (rows_b[0], None)))
    out = gemm(*args)
    err = float(np.max(np.abs(np.asarray(out) - want)) / np.max(np.abs(want)))
    text = gemm.lower(*args).compile().as_text()
    gathered_rows = any(" all-gather(" in l and "[256," in l.split("=")[1].split("all-gather")[0]
                        and "f32" not in l.split("=")[1].split("all-gather")[0] for l in text.splitlines())
    print("CASE", tuple(out.sharding.spec), err, gathered_rows)
"""


@pytest.mark.slow
def test_the_partitioning_rule_splits_rows_and_gathers_only_k():
    """On 8 CPU devices with the kernel's arithmetic as the local function: every split of
    the operands gives the unsplit product, the result split by a's rows and b's (a's rows
    not gathered), and K gathered where it is split."""
    from tests.support.forced_devices import run_python

    proc = run_python(["-c", PARTITIONED])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("CASE")]
    assert len(cases) == 3, proc.stdout
    (spec1, err1, gathered1), (spec2, err2, _), (spec3, err3, _) = (c.rsplit(" ", 2) for c in cases)
    assert max(map(float, (err1, err2, err3))) <= 1e-6, cases
    assert (spec1, gathered1) == ("('fsdp', 'tensor')", "False"), cases
    assert spec3 == "(None, 'tensor')", cases  # a's K split: K gathered
    # both on fsdp: one side keeps the split (the partitioner picks which), the other is gathered
    assert spec2 in ("('fsdp', None)", "(None, 'fsdp')"), cases
