"""GEMM backends (docs/backends.md): the native paths against the reference on CPU, and the
programs lowered for CUDA on this CPU machine.

JAX executes both native paths on CPU (XLA upcasts the FP8 dot; ``jax.nn.scaled_matmul``
lowers to a dequantize-and-dot composite), so with FP32 activations they must equal the
reference up to FP32 summation order. Lowering with ``lowering_platforms=("cuda",)`` shows
what a GPU would compile: ``lax.platform_dependent`` keeps only the CUDA branch there.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from bench.backend_check import inputs, linear_vjp_fn, rel_err
from bench.hlo_gemms import block_scaled_dots, fp8_dots, lowered_gemms
from lp_jax import context
from lp_jax.gemm import backends
from tests.support.jaxpr_eqns import count_eqns

RECIPES = {
    "fp8_cs": lp.get_recipe("fp8_cs"),
    "fp8_cs_e4m3": lp.get_recipe("fp8_cs", fp8_format="E4M3"),
    "fp8_block": lp.get_recipe("fp8_block"),
    "fp8_block_hybrid": lp.get_recipe("bf16_with_fp8_subchannel_scaling_mixed"),  # E5M2 gradients
    "mxfp8": lp.get_recipe("mxfp8"),
    "mxfp8_floor": lp.get_recipe("mxfp8", scale_rule="floor"),
    "nvfp4": lp.get_recipe("nvfp4"),  # stochastic rounding on
    "nvfp4_no_sr": lp.get_recipe("nvfp4", disable_stochastic_rounding=True),
    "nvfp4_1d_no_rht": lp.get_recipe("nvfp4", disable_2d=True, disable_rht=True),
    "nvfp4_4over6": lp.get_recipe("nvfp4", block_scale_search="4over6", block_scale_search_on="all"),
}
# x [..., K] x W [K, N]: K not a multiple of 32 or 16, M (all leading axes) not a multiple of
# 128 (50, and 130 > 128), N not a multiple of 16 (dgrad contracts over it), leading axes.
SHAPES = [((2, 25, 40), 24), ((130, 72), 48)]
# FP8 block scaling's 1x128 blocks and 128x128 tiles: several of them, ragged at every edge.
CASES = [(n, s) for n in RECIPES for s in SHAPES] + [("fp8_block", ((3, 70, 300), 136))]
# Operand element types of fprop, dgrad, wgrad (lhs, rhs[, lhs scales, rhs scales]).
NATIVE_TYPES = {
    "fp8_cs": [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")],
    "fp8_block": [("f8E4M3FN", "f8E4M3FN", "f8E8M0FNU", "f8E8M0FNU")] * 3,  # run as MXFP8
    # fprop in E4M3; dgrad (dy W^T) and wgrad (x^T dy) with dy's E5M2
    "bf16_with_fp8_subchannel_scaling_mixed": [("f8E4M3FN", "f8E4M3FN", "f8E8M0FNU", "f8E8M0FNU"),
                                               ("f8E5M2", "f8E4M3FN", "f8E8M0FNU", "f8E8M0FNU"),
                                               ("f8E4M3FN", "f8E5M2", "f8E8M0FNU", "f8E8M0FNU")],
    "mxfp8": [("f8E4M3FN", "f8E4M3FN", "f8E8M0FNU", "f8E8M0FNU")] * 3,
    "nvfp4": [("f4E2M1FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN")] * 3,
}


@functools.lru_cache(maxsize=None)
def _jitted(recipe):
    return jax.jit(linear_vjp_fn(recipe))


def _native(recipe):
    return lp.get_recipe(recipe, backend=lp.get_recipe(recipe).native_backend)


@pytest.mark.parametrize("name,shape", CASES,
                         ids=[f"{n}-" + "x".join(map(str, s[0])) + f"x{s[1]}" for n, s in CASES])
def test_native_backend_on_cpu_equals_reference(name, shape):
    """fprop, dgrad and wgrad to FP32 summation order, stochastic rounding on and off."""
    ref_recipe = lp.get_recipe(RECIPES[name], backend="reference")
    native = _native(RECIPES[name])
    args = inputs(*shape)
    ref = _jitted(ref_recipe)(*args)
    got = _jitted(native)(*args)
    for r, g, what in zip(ref, got, ("y", "dx", "dW")):
        assert g.dtype == r.dtype == jnp.float32 and g.shape == r.shape
        assert rel_err(g, r) <= 1e-6, (what, rel_err(g, r))
    # ... and the native GEMMs are what ran (a forced backend has no other branch).
    assert _native_gemm_eqns(native, args) == 3
    assert _native_gemm_eqns(ref_recipe, args) == 0


def _native_gemm_eqns(recipe, args):
    """scaled_matmul calls and dot_generals of two FP8 operands in the traced program."""
    def native(eqn):
        return eqn.primitive.name == "scaled_matmul_wrapper" or (
            eqn.primitive.name == "dot_general"
            and all(str(v.aval.dtype).startswith("float8") for v in eqn.invars))
    return count_eqns(jax.make_jaxpr(linear_vjp_fn(recipe))(*args).jaxpr, native)


@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_native_backend_with_bf16_activations(name):
    """BF16 y and dx, FP32 dW; the outputs
    agree with the reference to BF16 rounding."""
    args = inputs((2, 25, 40), 24, jnp.bfloat16, seed=1)
    ref = _jitted(lp.get_recipe(name, backend="reference"))(*args)
    got = _jitted(_native(RECIPES[name]))(*args)
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    for r, g in zip(ref, got):
        assert rel_err(g, r) <= 1e-2


@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_auto_on_cpu_is_the_reference_bit_for_bit(name):
    args = inputs((2, 25, 40), 24)
    auto = _jitted(lp.get_recipe(name))(*args)
    ref = _jitted(lp.get_recipe(name, backend="reference"))(*args)
    for a, r in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def _linear_step(recipe, platform):
    """A quantized nnx.Linear's forward plus backward, lowered for ``platform``."""
    linear = nnx.Linear(40, 24, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                        rngs=nnx.Rngs(0))
    linear.dot_general = lp.dot_general(recipe)
    linear.promote_dtype = lp.KeepKernelDtype()
    graphdef, params = nnx.split(linear)

    def loss(params, x):
        with context.rng_scope(jax.random.key(0)):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

    x = jnp.ones((2, 25, 40), jnp.bfloat16)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(
        lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "bf16_with_fp8_subchannel_scaling_mixed", "mxfp8",
                                  "nvfp4"])
def test_linear_lowered_for_cuda_holds_three_native_gemms(name):
    gemms = lowered_gemms(_linear_step(name, "cuda"))
    found = fp8_dots(gemms) if name == "fp8_cs" else block_scaled_dots(gemms)
    assert sorted(found) == sorted(NATIVE_TYPES[name]), found
    cpu = lowered_gemms(_linear_step(name, "cpu"))
    assert not fp8_dots(cpu) and not block_scaled_dots(cpu)


_BLOCK_SCALED_RESULT = re.compile(r"@__op\$block_scaled_dot\(.*-> tensor<[0-9x]+x(\w+)>")


@pytest.mark.parametrize("name,results", [("mxfp8", {"bf16", "f32"}), ("fp8_block", {"bf16", "f32"}),
                                          ("nvfp4", {"f32"})])
def test_block_scaled_gemm_returns_bf16_for_cuda_where_nothing_follows_it(name, results):
    """Lowered for CUDA, a block-scaled GEMM without tensor scales (fprop, dgrad) returns
    BF16 and the weight gradient FP32; NVFP4's apply their tensor scales to an FP32 result.
    Lowered for CPU every call stays FP32 (the reference's bits: the test above)."""
    found = {m.group(1) for m in _BLOCK_SCALED_RESULT.finditer(_linear_step(name, "cuda"))}
    assert found == results, found


def test_block_scaled_gemm_keeps_fp32_where_a_tensor_axis_may_split_the_contraction():
    from lp_jax.gemm.cudnn import _rounds_in_gemm

    assert _rounds_in_gemm(jnp.bfloat16, None, None)
    assert not _rounds_in_gemm(jnp.float32, None, None)
    assert not _rounds_in_gemm(jnp.bfloat16, jnp.float32(2.0), None)
    split = jax.sharding.AbstractMesh((1, 2), ("data", "tensor"))
    with jax.sharding.use_abstract_mesh(split):
        assert not _rounds_in_gemm(jnp.bfloat16, None, None)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 1), ("data", "tensor"))):
        assert _rounds_in_gemm(jnp.bfloat16, None, None)


def test_forced_backend_that_does_not_fit_the_recipe_is_refused():
    for name, backend in (("fp8_cs", "cudnn"), ("mxfp8", "xla_fp8"), ("nvfp4", "xla_fp8")):
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot run recipe '{name}'"):
            lp.get_recipe(name, backend=backend)
    with pytest.raises(ValueError, match="not valid"):
        lp.get_recipe("mxfp8", backend="cublas")
    # BF16 quantizes nothing: every backend runs XLA's BF16 dot, so any name is accepted.
    assert backends.resolved(lp.get_recipe("bf16", backend="cudnn")) == "reference"


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_forced_backend_lowered_for_another_platform_fails_in_one_line(platform):
    f = linear_vjp_fn(lp.get_recipe("mxfp8", backend="cudnn"))
    args = inputs((2, 25, 40), 24)
    with pytest.raises(ValueError) as e:
        jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))
    assert f"backend 'cudnn' cannot run on '{platform}'" in str(e.value) and "\n" not in str(e.value)
    # auto lowers there, with the reference GEMMs
    text = jax.jit(linear_vjp_fn(lp.get_recipe("mxfp8"))).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert not block_scaled_dots(lowered_gemms(text))


def test_backend_on_each_platform():
    for name, native in (("fp8_cs", "xla_fp8"), ("mxfp8", "cudnn"), ("nvfp4", "cudnn")):
        recipe = lp.get_recipe(name)
        assert backends.backend_on(recipe, "cuda") == native
        assert backends.backend_on(recipe, "cpu") == backends.backend_on(recipe, "tpu") == "reference"
        assert backends.backend_on(lp.get_recipe(name, backend=native), "cpu") == native
    assert backends.backend_on(lp.get_recipe("bf16"), "cuda") == "reference"


def test_swap_report_names_the_backend_on_this_platform():
    from tests.support.toy_models import Toy

    report = lp.apply_recipe(Toy(num_layers=4), lp.get_recipe("mxfp8", policy="F1L1"))
    assert report.platform == "cpu"
    assert report.backends == {"MXFP8BlockScaling": "reference", "BF16": "reference"}
    assert str(report).splitlines()[0].endswith("GEMMs on cpu: MXFP8BlockScaling via reference, BF16 via reference")
    forced = lp.apply_recipe(Toy(num_layers=4), lp.get_recipe("nvfp4", policy="F0L1", backend="cudnn"))
    assert forced.backends == {"NVFP4BlockScaling": "cudnn", "BF16": "reference"}


def test_platform_dependent_under_shard_map_remat_and_vmap():
    """The per-GEMM platform choice inside the custom_vjp survives the transformations a
    model puts around a Linear: bit-identical to the reference on CPU, native for CUDA."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    args = inputs((4, 25, 40), 24)

    def wrapped(recipe):
        inner = jax.checkpoint(linear_vjp_fn(recipe), policy=jax.checkpoint_policies.dots_saveable)
        spec = jax.P("d")
        sm = jax.shard_map(inner, mesh=mesh, in_specs=(spec, jax.P(), spec), out_specs=(spec, spec, jax.P()),
                           check_vma=False)
        return jax.jit(lambda x, w, dy: jax.vmap(sm, in_axes=(0, None, 0))(x[None], w, dy[None]))

    auto, ref = wrapped(lp.get_recipe("nvfp4")), wrapped(lp.get_recipe("nvfp4", backend="reference"))
    for a, r in zip(auto(*args), ref(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    cuda = lowered_gemms(auto.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert len(block_scaled_dots(cuda)) == 3
    forced = wrapped(lp.get_recipe("nvfp4", backend="cudnn"))(*args)  # the guard under vmap
    for f, r in zip(forced, ref(*args)):
        assert rel_err(f, r) <= 1e-6


# ----------------------------------------------------------------- the tiny Llama's train step

def _llama(recipe, dtype=jnp.bfloat16, scan_layers=False, num_layers=None):
    """(graphdef, StepSpec, state, SwapReport) of the trainer's step for the tiny Llama."""
    from lp_jax.parallel.mesh import make_mesh
    from lp_jax.parallel.partitioning import state_shardings
    from lp_jax.training import state as state_lib
    from lp_jax.training.optimizer import make_optimizer
    from lp_jax.training.step import StepSpec
    from models import llama
    from tests.support.toy_models import opt_spec

    cfg = llama.preset("tiny", dtype=jnp.dtype(dtype), scan_layers=scan_layers)
    if num_layers is not None:
        cfg = cfg.replace(num_layers=num_layers)
    mesh = make_mesh(1, 1)
    spec = StepSpec(opt_spec(), 1, mesh)
    tx = make_optimizer(spec.optimizer)
    build = lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    abstract = nnx.eval_shape(build)
    report = lp.apply_recipe(abstract, recipe)
    graphdef, params, rest = state_lib.split_model(abstract)
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    state = state_lib.init_state(build, tx, 0, state_shardings(target, mesh))
    return graphdef, spec, state, report


def _step_args(graphdef, spec, state):
    from lp_jax.training.state import place_batch
    from tests.support.toy_models import batch

    return graphdef, spec, state, place_batch(batch(4), 1, spec.mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_llama_train_step_with_each_backend_forced_matches_reference(name):
    """One optimizer step, FP32 activations (so the GEMMs differ only in summation order):
    loss, gradient norm and updated parameters agree to 1e-6. Two layers, the first
    quantized and the last in BF16 (compiling four layers twice per recipe took minutes)."""
    from lp_jax.training.step import train_step

    policy = "F0L1"
    results = {}
    for backend in ("reference", lp.get_recipe(name).native_backend):
        recipe = lp.get_recipe(name, policy=policy, backend=backend)
        graphdef, spec, state, report = _llama(recipe, dtype=jnp.float32, num_layers=2)
        assert len(report.quantized) == 7  # layer 0 of 2, seven Linears
        new_state, metrics = train_step(*_step_args(graphdef, spec, state))
        results[backend] = (metrics, new_state["params"])
    (m_ref, p_ref), (m_nat, p_nat) = results.values()
    assert abs(float(m_nat["loss"]) - float(m_ref["loss"])) <= 1e-6 * abs(float(m_ref["loss"]))
    assert rel_err(m_nat["grad_norm"], m_ref["grad_norm"]) <= 1e-6
    for a, b in zip(jax.tree.leaves(p_nat), jax.tree.leaves(p_ref)):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_llama_train_step_lowered_for_cuda_holds_three_native_gemms_per_quantized_linear(name):
    from lp_jax.training.step import jitted_train_step

    graphdef, spec, state, report = _llama(lp.get_recipe(name, policy="F1L1"))
    args = _step_args(graphdef, spec, state)
    traced = jitted_train_step(spec, state).trace(*args)
    cuda = lowered_gemms(traced.lower(lowering_platforms=("cuda",)).as_text())
    native = fp8_dots(cuda) if name == "fp8_cs" else block_scaled_dots(cuda)
    # Exactly three per quantized Linear: none in the BF16 layers 0 and 3 or the LM head.
    assert len(report.quantized) == 14 and len(native) == 3 * 14
    assert set(native) == set(NATIVE_TYPES[name])
    cpu = lowered_gemms(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert not fp8_dots(cpu) and not block_scaled_dots(cpu)


SHARDED = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import lp_jax as lp
from lp_jax.gemm import backends

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 32, 128)).astype(np.float32)
w = (rng.standard_normal((128, 64)) * 0.1).astype(np.float32)
dn = (((2,), (0,)), ((), ()))
mesh = jax.make_mesh((2, 4), ("d", "t"), axis_types=(AxisType.Auto,) * 2)  # the trainer's kind
layouts = {"column": (P("d", None, None), P(None, "t")), "row": (P("d", None, "t"), P("t", None)),
           "fsdp": (P("d", None, None), P("d", "t"))}
worst = 0.0
for name in ("fp8_cs", "mxfp8", "nvfp4"):
    recipe = lp.get_recipe(name, backend=lp.get_recipe(name).native_backend)
    f = jax.jit(lambda x, w: jax.vjp(lambda x, w: lp.dot_general(recipe)(x, w, dn), x, w)[1](
        lp.dot_general(recipe)(x, w, dn)))
    ref = jax.jit(lambda x, w: jax.vjp(lambda x, w: lp.dot_general(lp.get_recipe(name, backend="reference"))(x, w, dn), x, w)[1](
        lp.dot_general(lp.get_recipe(name, backend="reference"))(x, w, dn)))(x, w)
    for layout, (xs, ws) in layouts.items():
        with jax.set_mesh(mesh):
            got = f(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
        for g, r in zip(got, ref):
            g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
            worst = max(worst, float(np.max(np.abs(g - r)) / np.max(np.abs(r))))
print("WORST", worst)
'''


@pytest.mark.slow
def test_native_backends_on_a_sharded_auto_mesh():
    """8 CPU devices, Megatron's column/row-parallel and FSDP layouts: the partitioned native
    GEMMs (jax.nn.scaled_matmul's partitioning rule, XLA's FP8 dot) give the unsharded
    reference's dx and dW to FP32 summation order."""
    from tests.support.forced_devices import run_python

    proc = run_python(["-c", SHARDED])
    worst = float(proc.stdout.split("WORST")[1])
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_scanned_llama_step_is_the_reference_on_cpu_and_native_for_cuda():
    """platform_dependent inside the custom_vjp inside the layer scan (and the micro-batch
    scan of the step): lowered for CPU the step computes the reference bit for bit; lowered
    for CUDA the scanned layers' GEMMs are block-scaled dots."""
    from lp_jax.training.step import jitted_train_step, train_step

    runs = {}
    for backend in ("auto", "reference"):
        graphdef, spec, state, _ = _llama(lp.get_recipe("mxfp8", backend=backend), scan_layers=True)
        args = _step_args(graphdef, spec, state)
        if backend == "auto":
            cuda = jitted_train_step(spec, state).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        runs[backend] = jax.tree.map(np.asarray, train_step(*args))
    for a, r in zip(jax.tree.leaves(runs["auto"]), jax.tree.leaves(runs["reference"])):
        np.testing.assert_array_equal(a, r)
    # All four layers share one scanned body: its seven Linears, three GEMMs each.
    assert len(block_scaled_dots(lowered_gemms(cuda))) == 21
