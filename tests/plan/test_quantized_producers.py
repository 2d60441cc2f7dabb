"""What XLA's GPU compiler writes around XLA's quantizers, compiled for a GPU (JAX's CUDA
plugin, no GPU needed): an MLP block rebuilt in the backward (``remat=mlp``'s shape) writes no
float32 tensor of its [tokens, F] shape. XLA may drop a float32 -> bf16 -> float32 round
trip (excess precision); where a quantizer widened its bf16 input with a convert, the
compiler handed it the producer's float32 value instead, written at twice the bytes and
never rounded to bf16 as the quantizer's contract says (``formats.exact_f32``; it did so to
FP8-CS on B200 and to MXFP8 and NVFP4, whose XLA quantizers Hopper runs, on H200)."""
import functools
import math
import re

import pytest

from tests.support.plan_targets import needs_plugin

pytestmark = pytest.mark.gpu_compile
SMALL = (512, 256, 1024)  # tokens, D, F
LLAMA3_8B = (8192, 4096, 14336)  # one 8192-token sequence; XLA fuses differently at this size
_FUSION_OUT = re.compile(r"^\s*%\S+ = (.+?) fusion\(", re.M)


def _compiled_mlp(recipe, gpu, tokens, d, f):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import lp_jax
    from lp_jax.gemm.prepared_kernel import prepare
    from lp_jax.plan.compile_step import topology_devices
    from lp_jax.plan.gpus import GPUS
    from lp_jax.recipes import get_recipe
    from models.activation_vjp import swiglu
    from models.layers import REBUILD_POLICY

    dot = lp_jax.dot_general(recipe)

    def linear(x, w):
        return dot(x, w, (((1,), (0,)), ((), ())))

    # Rebuilt in the backward as remat="mlp" rebuilds it (models.layers).
    @functools.partial(jax.checkpoint, policy=REBUILD_POLICY)
    def mlp(x, wg, wu, wd):
        return linear(swiglu(linear(x, wg), linear(x, wu)), wd)

    def loss(x, *weights):
        return jnp.sum(mlp(x, *weights).astype(jnp.float32) ** 2)

    sharding = NamedSharding(Mesh(topology_devices(GPUS[gpu], 1), ("x",)), P())
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
    # The step hands the layers their weights' copies made ahead (precision.cache_weights).
    r = get_recipe(recipe)
    kernels = [jax.tree.map(abstract, jax.eval_shape(lambda w: prepare(r, w, jnp.bfloat16),
                                                     jax.ShapeDtypeStruct(shape, jnp.float32)))
               for shape in ((d, f), (d, f), (f, d))]
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16, sharding=sharding)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, *kernels).lower().compile().as_text()


@needs_plugin
@pytest.mark.parametrize("recipe,gpu,shape", [("fp8_cs", "b200", SMALL), ("fp8_cs", "h200", SMALL),
                                              ("mxfp8", "h200", SMALL), ("nvfp4", "h200", SMALL),
                                              ("fp8_cs", "b200", LLAMA3_8B)])
def test_a_quantized_mlp_writes_no_float32_activation(recipe, gpu, shape):
    """At the 8B's shape FP8-CS also caught SwiGLU's backward: with dy's amax fused into it,
    XLA wrote exp(-gate) in float32 for it (lp_jax.gemm.dot_general fences dy)."""
    tokens, _, f = shape
    outputs = _FUSION_OUT.findall(_compiled_mlp(recipe, gpu, *shape))
    assert any(re.search(r"f8e4m3fn|f4e2m1fn|u8\[", o) for o in outputs), "no quantized copies"
    written = [o for o in outputs if f"f32[{tokens},{f}]" in o]
    assert not written, written


def scaling_only_kernels(hlo, elements):
    """Fusions that read one float32 array of ``elements`` and write it as one bf16 array:
    a GEMM's FP32 result scaled and cast in a pass of its own."""
    from lp_jax.plan.hlo_module import Module, arrays

    module = Module.parse(hlo)

    def full_size(shape):
        return [dtype for dtype, dims in arrays(shape) if math.prod(dims) == elements]

    return [i.name for c in module.computations.values() for i in c.instructions
            if i.opcode == "fusion" and len(arrays(i.shape)) == 1 and full_size(i.shape) == ["bf16"]
            and [d for o in i.operands for d in full_size(module.operand_shape(o))] == ["f32"]]


@needs_plugin
@pytest.mark.parametrize("shape", [SMALL])
def test_nvfp4_gemm_results_are_scaled_inside_their_consumers(shape):
    """NVFP4's tensor factors multiply each FP32 GEMM result as plain multiplies on CUDA
    (``operands.scale_result``), which XLA fuses into SwiGLU and its backward. Through
    ``formats.mul`` (what CPU needs) each [tokens, F] result was scaled and cast by a kernel
    of its own (three here). At the 8B's shape XLA still keeps one apart (the rebuilt gate,
    which SwiGLU's backward reads in several places; docs/plan.md)."""
    tokens, _, f = shape
    passes = scaling_only_kernels(_compiled_mlp("nvfp4", "b200", *shape), tokens * f)
    assert len(passes) <= 1, passes
