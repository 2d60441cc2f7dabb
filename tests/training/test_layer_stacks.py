"""The train step differentiates a scanned model through layer stacks made once per step
(lp_jax.training.layer_stacks): the same step, bit for bit, as the model stacking its own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax.training import step as step_lib
from lp_jax.training.layer_stacks import LayerStacks
from lp_jax.training.state import place_batch
from models import llama
from tests.support.toy_models import batch


def _setup(recipe, num_layers=4):
    from lp_jax.parallel.mesh import make_mesh
    from lp_jax.parallel.partitioning import state_shardings
    from lp_jax.training import state as state_lib
    from lp_jax.training.optimizer import make_optimizer
    from tests.support.toy_models import opt_spec

    cfg = llama.preset("tiny", scan_layers=True).replace(num_layers=num_layers)
    mesh = make_mesh(1, 1)
    spec = step_lib.StepSpec(opt_spec(), 2, mesh)
    tx = make_optimizer(spec.optimizer)
    def build():
        model = llama.Llama(cfg, rngs=nnx.Rngs(0))
        lp.apply_recipe(model, recipe)
        return model

    abstract = nnx.eval_shape(build)
    graphdef, params, rest = state_lib.split_model(abstract)
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    state = state_lib.init_state(build, tx, 0, state_shardings(target, mesh))
    return graphdef, spec, state


class _NoStacks(LayerStacks):
    def __bool__(self):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_stacked_once_equals_stacked_per_call(recipe, monkeypatch):
    """NVFP4 with its last layer in BF16 scans a run of 3 and calls one layer alone, and
    draws stochastic-rounding bits per layer: both paths give the same step exactly."""
    rec = lp.get_recipe(recipe, policy="F0L1") if recipe != "bf16" else recipe
    graphdef, spec, state = _setup(rec)
    host = place_batch(batch(4), spec.accum_steps, spec.mesh)
    copy = jax.tree.map(jnp.copy, state)
    new, metrics = step_lib.train_step(graphdef, spec, state, host)
    step_lib._jitted_train_step.cache_clear()
    monkeypatch.setattr(step_lib, "LayerStacks", _NoStacks)
    ref, ref_metrics = step_lib.train_step(graphdef, spec, copy, host)
    step_lib._jitted_train_step.cache_clear()
    assert float(metrics["loss"]) == float(ref_metrics["loss"])
    assert float(metrics["grad_norm"]) == float(ref_metrics["grad_norm"])
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_and_unsplit_round_trip():
    graphdef, _, state = _setup(lp.get_recipe("nvfp4", policy="F1L1"), num_layers=5)
    params, rest = state["params"], state["rest"]
    stacks = LayerStacks(graphdef, params, rest)
    assert stacks.runs == ((1, 4),)  # layers 0 and 4 in BF16, each called alone
    outer, stacked = stacks.split()
    assert set(stacked) == {1}
    kernel = stacked[1]["attn"]["q_proj"]["kernel"][...]
    assert kernel.shape[0] == 3
    np.testing.assert_array_equal(kernel[2], params["layers"][3]["attn"]["q_proj"]["kernel"][...])
    back = stacks.unsplit(outer, stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unscanned_model_has_no_stacks():
    graphdef, _, state = _setup("bf16")
    cfg_off = llama.preset("tiny")
    model = llama.Llama(cfg_off, rngs=nnx.Rngs(0))
    g, p, r = nnx.split(model, nnx.Param, ...)
    assert not LayerStacks(g, p, r)
    assert LayerStacks(graphdef, state["params"], state["rest"]).runs == ((0, 4),)
