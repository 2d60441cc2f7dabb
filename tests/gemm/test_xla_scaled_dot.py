"""The "xla_scaled_dot" backend (docs/backends.md): block-scaled GEMMs as XLA's scaled dot.

On CPU JAX decomposes ``lax.scaled_dot`` into the reference's own GEMM (values dequantized
into BF16, exactly, then a BF16 dot with FP32 accumulation), so the backend must give the
reference's bits (FP8 block's to FP32 summation order). Lowered for CUDA it must be the ``xla.scaled_dot`` composite, three per
Linear, and no cuDNN call.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from bench.backend_check import inputs, linear_vjp_fn, rel_err
from bench.hlo_gemms import block_scaled_dots, lowered_gemms

RECIPES = {
    "mxfp8": lp.get_recipe("mxfp8", backend="xla_scaled_dot"),
    "nvfp4": lp.get_recipe("nvfp4", backend="xla_scaled_dot"),  # stochastic rounding on
    "nvfp4_no_sr": lp.get_recipe("nvfp4", disable_stochastic_rounding=True, backend="xla_scaled_dot"),
    "fp8_block": lp.get_recipe("fp8_block", backend="xla_scaled_dot"),
}


def _reference(recipe):
    return lp.get_recipe(recipe.name, backend="reference", **{
        k: getattr(recipe, k) for k in ("disable_stochastic_rounding",) if hasattr(recipe, k)})


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("x_shape,n", [((2, 25, 40), 24), ((3, 7, 130), 33)])
def test_equals_the_reference_bit_for_bit_on_cpu(name, x_shape, n):
    recipe = RECIPES[name]
    args = inputs(x_shape, n, jnp.bfloat16)
    got = jax.jit(linear_vjp_fn(recipe))(*args)
    ref = jax.jit(linear_vjp_fn(_reference(recipe)))(*args)
    for g, r in zip(got, ref):
        if name == "fp8_block":
            # Its 1x128 and 128x128 blocks enter as repeated 1x32 ones, the 128x128 tiles
            # read along either axis: XLA:CPU's dot then sums in another order than the
            # reference's (1e-7 relative here), as the cudnn backend does.
            assert rel_err(g, r) <= 1e-6
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_lowered_for_cuda_it_is_the_scaled_dot_composite_and_no_cudnn_call():
    for name in ("mxfp8", "nvfp4"):
        f = linear_vjp_fn(RECIPES[name])
        text = jax.jit(f).trace(*inputs((2, 25, 40), 24)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count('stablehlo.composite "xla.scaled_dot"') == 3, name
        assert not block_scaled_dots(lowered_gemms(text)), name


def test_only_block_formats_run_on_it():
    with pytest.raises(ValueError, match="backend='xla_scaled_dot' cannot run recipe 'fp8_cs'"):
        lp.get_recipe("fp8_cs", backend="xla_scaled_dot")
    assert lp.get_recipe("mxfp8").native_backends == ("cudnn", "xla_scaled_dot")
    assert lp.get_recipe("mxfp8").backend == "auto"  # auto stays on cuDNN: docs/backends.md


TWO_DEVICES = r'''
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import lp_jax as lp
from bench.backend_check import inputs, linear_vjp_fn

mesh = jax.make_mesh((2,), ("d",))
x, w, dy = inputs((4, 25, 40), 24)
x = jax.device_put(x, NamedSharding(mesh, P("d")))
f = jax.jit(linear_vjp_fn(lp.get_recipe("nvfp4", backend="xla_scaled_dot")))
f(x, w, dy)  # runs on the CPU's two devices
try:
    f.trace(x, w, dy).lower(lowering_platforms=("cuda",))
except ValueError as e:
    print("REFUSED", e)
jax.config.update("jax_use_shardy_partitioner", False)
f.trace(x, w, dy).lower(lowering_platforms=("cuda",))
print("GSPMD LOWERED")
'''


def test_refused_in_one_line_for_cuda_on_two_devices_under_shardy():
    """XLA cannot compile the scaled dot partitioned by Shardy for CUDA: the lowering says so
    in one line and names the way out (GSPMD), which lowers; the CPU runs it either way."""
    from tests.support.forced_devices import run_python

    out = run_python(["-c", TWO_DEVICES], devices=2).stdout
    refused = out.split("REFUSED ")[1].splitlines()[0]
    assert "does not compile for CUDA on more than one device" in refused
    assert "JAX_USE_SHARDY_PARTITIONER=false" in refused
    assert "GSPMD LOWERED" in out
