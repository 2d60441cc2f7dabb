"""precision.bf16_layers: exactly the listed layers run in BF16 (on top of FiLj), in unrolled
and scanned stacks; apply_recipe's report and the config say so; bad lists are refused."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax.config.yaml_io import load_config
from lp_jax.errors import UserError
from lp_jax.training.validate import resolve
from tests.support.toy_models import LINEARS_OF_BLOCK, StackedToy, Toy, unrolled_like

TOKENS = jnp.arange(32).reshape(2, 16) % 64


def _bf16_in(model):
    return [i for i, block in enumerate(model.layers)
            if isinstance(getattr(block, LINEARS_OF_BLOCK[0]).dot_general.recipe, lp.BF16)]


def test_listed_layers_and_filj_run_in_bf16():
    model = Toy(num_layers=6)
    report = lp.apply_recipe(model, lp.get_recipe("nvfp4", policy="F1L0", bf16_layers=[4, 2, 4]))
    assert _bf16_in(model) == [0, 2, 4]
    assert report.policy == "F1L0+bf16[2,4]"
    assert len(report.quantized) == 3 * 3 and len(report.bf16_by_policy) == 3 * 3
    text = str(report)
    assert "(F1L0+bf16[2,4])" in text.splitlines()[0]
    assert "BF16 (layer policy): layers/{0,2,4}/" in text
    for name in LINEARS_OF_BLOCK:  # every Linear of a listed layer, none of the others
        assert [i for i, b in enumerate(model.layers)
                if isinstance(getattr(b, name).dot_general.recipe, lp.BF16)] == [0, 2, 4]


def test_scanned_stack_keeps_the_listed_slices_in_bf16():
    stacked = StackedToy(num_layers=3)
    unrolled = unrolled_like(stacked)
    recipe = lp.get_recipe("mxfp8", bf16_layers=[1])
    report = lp.apply_recipe(stacked, recipe)
    assert set(report.per_slice.values()) == {"F0L0+bf16[1]"}
    lp.apply_recipe(unrolled, recipe)
    assert _bf16_in(unrolled) == [1]
    run = nnx.jit(lambda m, t: m(t))
    out_s = np.asarray(run(stacked, TOKENS), np.float32)
    np.testing.assert_array_equal(out_s, np.asarray(run(unrolled, TOKENS), np.float32))
    # and the slice really ran in BF16: all-quantized gives another output
    lp.apply_recipe(stacked, lp.get_recipe("mxfp8"))
    assert not np.array_equal(out_s, np.asarray(run(stacked, TOKENS), np.float32))


@pytest.mark.parametrize("layers", [[-1], ["a"], [1.5], "0"])
def test_bad_lists_are_refused(layers):
    with pytest.raises(ValueError, match="bf16_layers"):
        lp.get_recipe("mxfp8", bf16_layers=layers)


def test_a_layer_beyond_the_model_is_refused():
    with pytest.raises(ValueError, match=r"bf16_layers \[6\] are not layers of this model"):
        lp.apply_recipe(Toy(num_layers=6), lp.get_recipe("mxfp8", bf16_layers=[6]))


def test_config_key(tmp_path):
    base = [f"run_dir={tmp_path}", "data.source=mock", "precision=nvfp4",
            "precision.last_bf16_layers=0"]
    plan = resolve(load_config(None, base + ["precision.bf16_layers=[0, 3]"]))
    assert plan.phases[0].recipe.bf16_layers == (0, 3)
    assert plan.phases[0].recipe.policy == "F0L0+bf16[0,3]"
    with pytest.raises(UserError, match=r"precision.bf16_layers=4 is invalid: layers are 0..3"):
        resolve(load_config(None, base + ["precision.bf16_layers=[4]"]))
