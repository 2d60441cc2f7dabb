"""The scanned layers' weight copies made once per step (lp_jax.training.weight_cache): the
same step, bit for bit, as each micro-batch making them, for every recipe."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.gemm.prepared_kernel import PreparedKernel, prepare
from lp_jax.training import step as step_lib
from lp_jax.training import weight_cache
from lp_jax.training.layer_stacks import LayerStacks
from lp_jax.training.state import place_batch
from tests.support.toy_models import batch
from tests.training.test_layer_stacks import _setup


def _step(graphdef, spec, state, host):
    out = step_lib.train_step(graphdef, spec, jax.tree.map(jnp.copy, state), host)
    step_lib._jitted_train_step.cache_clear()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_copies_made_once_per_step_give_the_same_step(recipe, monkeypatch):
    """Two micro-batches, a run of 3 scanned layers and one alone (NVFP4: stochastic
    rounding and the RHT on the activations' and gradients' copies)."""
    rec = lp.get_recipe(recipe, policy="F0L1") if recipe != "bf16" else recipe
    graphdef, spec, state = _setup(rec)
    assert spec.cache_weights and spec.accum_steps == 2
    host = place_batch(batch(4), spec.accum_steps, spec.mesh)
    jax.clear_caches()  # an earlier test may have traced this very step: trace it again
    prepared = []
    real = LowPrecisionDotGeneral._prepared_gemm
    monkeypatch.setattr(LowPrecisionDotGeneral, "_prepared_gemm",
                        lambda self, *a: prepared.append(self.recipe.name) or real(self, *a))
    new, metrics = _step(graphdef, spec, state, host)
    assert len(prepared) == 7  # the scanned run's Linears, traced once; the lone layer's are not
    ref, ref_metrics = _step(graphdef, dataclasses.replace(spec, cache_weights=False), state, host)
    assert float(metrics["loss"]) == float(ref_metrics["loss"])
    assert float(metrics["grad_norm"]) == float(ref_metrics["grad_norm"])
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_scanned_linear_is_prepared_per_layer():
    graphdef, _, state = _setup(lp.get_recipe("fp8_cs", policy="F0L1"))
    stacks = LayerStacks(graphdef, state["params"], state["rest"])
    linears = weight_cache.prepared_linears(stacks)
    assert set(linears) == {0}
    names = {path[-2] for path in linears[0]}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    _, layer_stacks = stacks.split()
    copies = weight_cache.make(stacks, layer_stacks)
    recipe, dtype, (fw, dgrad_w) = copies[0][("attn", "q_proj", "kernel")]
    assert dgrad_w is None  # per-tensor FP8: one copy serves fprop and dgrad
    assert fw.data.dtype == jnp.float8_e4m3fn and fw.data.shape[0] == 3
    # Layer 1's copy is layer 1's kernel quantized alone (its own scale).
    w1 = layer_stacks[0]["attn"]["q_proj"]["kernel"][...][1]
    alone = prepare(recipe, w1, dtype).fw
    np.testing.assert_array_equal(np.asarray(fw.data[1]), np.asarray(alone.data))
    np.testing.assert_array_equal(np.asarray(fw.scale[1]), np.asarray(alone.scale))
    attached = weight_cache.attach(layer_stacks, copies)
    kernel = jax.tree.leaves(attached[0]["attn"]["q_proj"]["kernel"],
                             is_leaf=lambda x: isinstance(x, PreparedKernel))[0]
    assert isinstance(kernel, PreparedKernel) and kernel.shape == w1.shape[:0] + (3,) + w1.shape


def test_a_kernel_prepared_for_another_recipe_or_dtype_is_refused():
    w = jnp.ones((32, 64), jnp.float32)
    x = jnp.ones((4, 32), jnp.bfloat16)
    kernel = prepare(lp.get_recipe("fp8_cs"), w, jnp.bfloat16)
    with pytest.raises(ValueError, match="made for recipe fp8_cs"):
        lp.dot_general("mxfp8")(x, kernel, (((1,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="for bfloat16 inputs"):
        lp.dot_general("fp8_cs")(x.astype(jnp.float32), kernel, (((1,), (0,)), ((), ())))
    dims = (((1,), (0,)), ((), ()))
    y = lp.dot_general("fp8_cs")(x, kernel, dims)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(lp.dot_general("fp8_cs")(x, w, dims)))
