"""apply_recipe: selection, FiLj, never the embedding or LM head, state tree untouched."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax import context
from tests.support.toy_models import StackedToy, Toy, loss_fn

LINEARS = ("q_proj", "up_proj", "down_proj")


def _bf16_layers(report):
    return sorted({int(p.split("/")[1]) for p in report.bf16_by_policy})


@pytest.mark.parametrize("recipe,expected", [
    ("fp8_cs", [0, 5]),        # F1L1
    ("nvfp4", [2, 3, 4, 5]),   # F0L4
    ("mxfp8", []),             # F0L0
])
def test_layer_policy_on_six_layers(recipe, expected):
    model = Toy(num_layers=6)
    report = lp.apply_recipe(model, recipe)
    assert _bf16_layers(report) == expected
    assert len(report.quantized) == 3 * (6 - len(expected))
    for i, block in enumerate(model.layers):
        for name in LINEARS:
            dg = getattr(block, name).dot_general
            assert isinstance(dg, lp.LowPrecisionDotGeneral)
            assert isinstance(dg.recipe, lp.BF16) == (i in expected)


def test_embedding_and_lm_head_never_quantized():
    model = Toy()
    report = lp.apply_recipe(model, "mxfp8", include=".*")
    assert "lm_head" in report.not_selected
    # not quantized, but lp_jax's BF16 GEMM: its weight gradient comes back in FP32
    assert model.lm_head.dot_general == lp.dot_general("bf16")
    assert report.fp32_weight_gradients == ["lm_head"]
    assert not any(p.startswith(("embed", "lm_head")) for p in report.quantized)
    lp.apply_recipe(model, "mxfp8", fp32_weight_gradients=False)
    assert model.lm_head.dot_general is jax.lax.dot_general


def test_head_gemm_keeps_logits_and_returns_fp32_weight_gradients():
    tokens = jnp.arange(16).reshape(2, 8)
    plain, swapped = Toy(), Toy()
    lp.apply_recipe(swapped, "bf16")
    np.testing.assert_array_equal(np.asarray(plain(tokens), np.float32),
                                  np.asarray(swapped(tokens), np.float32))
    grads = nnx.grad(lambda m: jnp.sum(m(tokens).astype(jnp.float32) ** 2))(swapped)
    assert grads.lm_head.kernel[...].dtype == jnp.float32


def test_report_says_which_linears_got_which_recipe():
    model = Toy(num_layers=6)
    text = str(lp.apply_recipe(model, lp.get_recipe("nvfp4", policy="F1L2")))
    assert "  NVFP4BlockScaling: layers/{1-3}/" in text
    assert "  BF16 (layer policy): layers/{0,4-5}/" in text
    assert "  BF16, FP32 weight gradient (not selected): lm_head" in text


def test_state_tree_unchanged_and_recipes_interchangeable():
    model = Toy()
    before = nnx.state(model)
    lp.apply_recipe(model, "nvfp4")
    after = nnx.state(model)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # a state saved under one recipe loads into a model swapped to another
    other = Toy(seed=1)
    lp.apply_recipe(other, "fp8_cs")
    nnx.update(other, after)
    tokens = jnp.arange(16).reshape(2, 8)
    ref = Toy()
    lp.apply_recipe(ref, "fp8_cs")
    np.testing.assert_array_equal(other(tokens), ref(tokens))


def test_reapplying_replaces_and_bf16_restores_outputs():
    model, plain = Toy(), Toy()
    tokens = jnp.arange(16).reshape(2, 8)
    lp.apply_recipe(model, "mxfp8")
    assert not np.array_equal(model(tokens), plain(tokens))
    lp.apply_recipe(model, "bf16")
    np.testing.assert_allclose(np.asarray(model(tokens), np.float32),
                               np.asarray(plain(tokens), np.float32), rtol=0, atol=0)
    lp.apply_recipe(model, "nvfp4", include="up_proj")  # q_proj is no longer selected: reset
    assert model.layers[0].q_proj.dot_general == lp.dot_general("bf16")
    assert model.layers[0].up_proj.dot_general == lp.dot_general("nvfp4")


def test_include_exclude_and_unmatched_rules_refused():
    model = Toy()
    report = lp.apply_recipe(model, "mxfp8", include=["up_proj"], exclude="layers/0/")
    assert set(report.quantized) == {f"layers/{i}/up_proj" for i in range(1, 6)}
    # a rule that matches no GEMM is an error, and the model keeps what it had
    with pytest.raises(ValueError, match="include rule 'nothing_here' matches no GEMM"):
        lp.apply_recipe(model, "nvfp4", include=["up_proj", "nothing_here"], exclude="layers/0/")
    assert model.layers[1].up_proj.dot_general == lp.dot_general("mxfp8")


def test_policy_larger_than_model_is_an_error():
    with pytest.raises(ValueError, match="more layers in BF16"):
        lp.apply_recipe(Toy(num_layers=3), lp.get_recipe("nvfp4"))


@nnx.jit
def _grad_step(model, tokens, key):
    with context.rng_scope(jax.random.key(key)):
        return nnx.grad(loss_fn)(model, tokens)


def _grads(model, tokens, key=0):
    return _grad_step(model, tokens, jnp.uint32(key))


@pytest.mark.slow
def test_stacked_layers_get_the_policy_per_slice():
    """nnx.vmap-stacked blocks run under nnx.scan equal the unrolled model, per slice."""
    tokens = jnp.arange(32).reshape(2, 16) % 64
    stacked = StackedToy()
    unrolled = Toy()
    # copy the stacked weights into the unrolled model, layer by layer
    for i, block in enumerate(unrolled.layers):
        for name in LINEARS:
            getattr(block, name).kernel.set_value(getattr(stacked.layers, name).kernel[i])
    unrolled.embed.embedding.set_value(stacked.embed.embedding[...])
    unrolled.lm_head.kernel.set_value(stacked.lm_head.kernel[...])
    recipe = lp.get_recipe("fp8_cs")  # F1L1: first and last slices in BF16
    report = lp.apply_recipe(stacked, recipe)
    assert set(report.per_slice) == {f"layers/{n}" for n in LINEARS}
    lp.apply_recipe(unrolled, recipe)
    out_s = nnx.jit(lambda m, t: m(t))(stacked, tokens)
    out_u = nnx.jit(lambda m, t: m(t))(unrolled, tokens)
    np.testing.assert_array_equal(np.asarray(out_s, np.float32), np.asarray(out_u, np.float32))
    g_s, g_u = _grads(stacked, tokens), _grads(unrolled, tokens)
    np.testing.assert_allclose(g_s["layers"]["q_proj"]["kernel"][3],
                               g_u["layers"][3]["q_proj"]["kernel"][...], rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_stochastic_rounding_bits_differ_per_layer_and_repeat_per_key():
    model = Toy(num_layers=2)
    lp.apply_recipe(model, lp.get_recipe("nvfp4", policy="F0L0"))
    tokens = jnp.arange(32).reshape(2, 16) % 64
    a, b, c = _grads(model, tokens, 0), _grads(model, tokens, 0), _grads(model, tokens, 1)
    leaf = lambda g: g["layers"][0]["up_proj"]["kernel"][...]  # noqa: E731
    np.testing.assert_array_equal(leaf(a), leaf(b))
    assert not np.array_equal(leaf(a), leaf(c))
