"""XLA:CPU runs the reference GEMMs as its BF16 GEMM, not upcast to FP32 (a speed property
the numerics tests cannot see: both layouts give the same values up to FP32 summation
order). XLA:CPU upcasts a BF16 dot whose left operand is a transposed view, which the
wgrad's (contracting the tokens, the first axis) was until the reference contracted it as
(unit, tokens) (lp_jax/gemm/operands.py: f32_dot). Checked on the compiled program."""
import re

import jax
import jax.numpy as jnp
import pytest

import lp_jax as lp
from lp_jax import context

_DEF = re.compile(r"(%[\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= \w+\[[\d,]*\]\S* dot\((%[\w.\-]+), (%[\w.\-]+)\)")


def _dot_operand_types(hlo: str):
    types = dict(_DEF.findall(hlo))
    return [(types.get(a), types.get(b)) for a, b in _DOT.findall(hlo)]


@pytest.mark.parametrize("name", ["bf16", "fp8_cs", "nvfp4"])
def test_fprop_dgrad_and_wgrad_run_bf16_gemms_on_cpu(name):
    if jax.devices()[0].platform != "cpu":
        pytest.skip("a property of XLA:CPU")
    recipe = lp.get_recipe(name, policy="F0L0")

    def step(x, w, dy, key):
        with context.rng_scope(key):
            y, vjp = jax.vjp(lambda x, w: lp.dot_general(recipe)(x, w, (((1,), (0,)), ((), ()))), x, w)
            return y, vjp(dy)

    x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 48), jnp.float32)
    dy = jax.ShapeDtypeStruct((64, 48), jnp.bfloat16)
    hlo = jax.jit(step).lower(x, w, dy, jax.random.key(0)).compile().as_text()
    dots = _dot_operand_types(hlo)
    assert len(dots) == 3, dots  # fprop, dgrad, wgrad
    assert all(t == ("bf16", "bf16") for t in dots), dots
