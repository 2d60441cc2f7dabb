"""The quantized dot_general with quantize_impl="pallas" equals the XLA one bit for bit:
fprop, dgrad and wgrad of every recipe (the NVFP4 wgrad copies with the RHT and stochastic
rounding fused into the kernel), on the reference and the native backends; and the config key
reaches the recipe."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax import context

M, K, N = 40, 64, 48  # M not a multiple of 16 or 32: the RHT pads, the kernels pad tiles
DN = (((1,), (0,)), ((), ()))


def _grads(recipe, backend, impl, x, w, dy):
    dg = lp.dot_general(recipe, backend=backend, quantize_impl=impl)

    @jax.jit
    def run(x, w, dy):
        with context.rng_scope(jax.random.key(11)):  # SR bits keyed as in training
            y, vjp = jax.vjp(lambda x, w: dg(x, w, DN), x, w)
        return (y, *vjp(dy))
    return [np.asarray(a) for a in run(x, w, dy)]


@pytest.mark.parametrize("recipe, backend", [("fp8_cs", "reference"), ("mxfp8", "reference"),
                                             ("nvfp4", "reference"), ("nvfp4", "cudnn")])
def test_fprop_dgrad_wgrad_equal_xla(recipe, backend):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) * 1e-3, jnp.bfloat16)
    want = _grads(recipe, backend, "xla", x, w, dy)
    got = _grads(recipe, backend, "pallas", x, w, dy)
    for name, g, v in zip(("fprop y", "dgrad dx", "wgrad dw"), got, want):
        assert g.dtype == v.dtype and np.array_equal(g.view(np.uint8), v.view(np.uint8)), (recipe, backend, name)
    assert np.abs(want[2]).max() > 0  # the gradients are not trivially equal


def test_quantize_impl_reaches_every_operand_and_is_checked(tmp_path):
    from lp_jax.config.yaml_io import load_config
    from lp_jax.errors import UserError
    from lp_jax.recipes import OPERAND_FIELDS
    from lp_jax.training.validate import resolve

    r = lp.get_recipe("nvfp4", quantize_impl="pallas")
    assert {getattr(r, f).quantize_impl for f in OPERAND_FIELDS} == {"pallas"}
    assert lp.get_recipe("mxfp8").quantize_impl == "auto"
    plan = resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", "precision=mxfp8",
                                      "precision.quantize_impl=pallas"]))
    assert plan.phases[0].recipe.quantize_impl == "pallas"
    with pytest.raises((UserError, ValueError)) as info:
        resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", "precision=mxfp8",
                                   "precision.quantize_impl=triton"]))
    assert "impl='triton' is not valid" in str(info.value) and "\n" not in str(info.value)
