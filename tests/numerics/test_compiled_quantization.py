"""Quantization must survive compilation: XLA may not fold f32 -> fp8 -> f32 round trips.

On GPU, XLA's excess-precision simplification may delete such round trips, which would
silently train in BF16. The dot_general puts the quantized bytes behind an optimization
barrier; these tests check the compiled CPU program of a jitted gradient step still holds
the low-precision types, and that a CUDA lowering keeps them behind the barrier.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax import context
from tests.support.toy_models import Toy, loss_fn

EXPECTED_TYPES = {
    "fp8_cs": ("f8e4m3fn", "f8e5m2"),
    "mxfp8": ("f8e4m3fn",),  # E8M0 scales travel as their uint8 codes (exact bits)
    "nvfp4": ("f4e2m1fn", "f8e4m3fn"),
}


def _step(recipe):
    model = Toy(num_layers=2, d=32)
    lp.apply_recipe(model, lp.get_recipe(recipe, policy="F0L0"))
    graphdef, state = nnx.split(model)

    def grad_step(state, tokens, key):
        def loss(state):
            with context.rng_scope(key):
                return loss_fn(nnx.merge(graphdef, state), tokens)
        return jax.grad(loss)(state)

    return jax.jit(grad_step), (state, jnp.zeros((2, 16), jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("recipe", list(EXPECTED_TYPES))
def test_compiled_gradient_step_keeps_low_precision_types(recipe):
    step, args = _step(recipe)
    hlo = step.lower(*args).compile().as_text()
    for t in EXPECTED_TYPES[recipe]:
        assert t in hlo, f"{t} missing from the compiled {recipe} step"


@pytest.mark.parametrize("recipe", ["fp8_cs", "nvfp4"])
def test_cuda_lowering_puts_quantized_bytes_behind_a_barrier(recipe):
    step, args = _step(recipe)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    fp_type = "f8E4M3FN" if recipe == "fp8_cs" else "f4E2M1FN"
    assert any(fp_type in line for line in barriers), f"no {fp_type} operand behind a barrier"
