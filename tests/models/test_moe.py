"""The MoE family (models.moe): routing and losses against a hand computation, the router
never quantized, experts through lp.ragged_dot under the layer policy, trained by train.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax import model_registry
from lp_jax.errors import UserError
from lp_jax.gemm.ragged_dot import LowPrecisionRaggedDot
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve
from models import moe
from tests.models.test_model_registry import tiny


def _model(**overrides):
    cfg = model_registry.preset("moe", "tiny", dtype=jnp.float32, **overrides)
    return model_registry.build_model("moe", cfg, nnx.Rngs(0)), cfg


def test_routed_mlp_equals_a_per_token_loop_and_megatrons_losses():
    """Each token's output is the sum over its top-k experts of the renormalized probability
    times that expert's SwiGLU; the load-balancing loss is Megatron's switch formula and the
    z-loss the mean squared logsumexp, computed here in NumPy."""
    model, cfg = _model(moe_z_loss_coeff=1e-2)
    layer = model.layers[0].mlp
    x = jax.random.normal(jax.random.key(1), (2, 24, cfg.hidden_size), jnp.float32)
    out, stats = layer(x)

    xs = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
    router = np.asarray(layer.router.kernel[...], np.float64)
    gate_up, down = (np.asarray(m.kernel[...], np.float64) for m in (layer.gate_up, layer.down))
    logits = xs @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    e, k, f = cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size
    expected, counts = np.zeros_like(xs), np.zeros(e)
    for t, row in enumerate(xs):
        top = np.argsort(-probs[t], kind="stable")[:k]
        weights = probs[t, top] / probs[t, top].sum()
        for w, expert in zip(weights, top):
            g, u = np.split(row @ gate_up[expert], [f])
            expected[t] += w * ((g / (1 + np.exp(-g))) * u) @ down[expert]
            counts[expert] += 1
    np.testing.assert_allclose(np.asarray(out).reshape(xs.shape), expected, rtol=2e-4, atol=2e-5)
    tokens = xs.shape[0]
    aux = cfg.moe_aux_loss_coeff * e * np.sum(counts / (tokens * k) * probs.mean(0))
    z = 1e-2 * np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(stats["aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(stats["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["load"]), counts * e / (tokens * k), rtol=1e-6)


def test_the_router_is_never_quantized_and_experts_take_the_layer_policy():
    model, _ = _model()
    report = lp.apply_recipe(model, lp.get_recipe("nvfp4", last_bf16_layers=1))
    assert report.num_layers == 4
    assert not any("router" in path for path in [*report.quantized, *report.bf16_by_policy, *report.not_selected])
    assert set(report.quantized) == {f"layers/{i}/{n}" for i in range(3) for n in (
        "attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_up", "mlp/down")}
    assert {"layers/3/mlp/gate_up", "layers/3/mlp/down"} <= set(report.bf16_by_policy)
    experts = model.layers[0].mlp.gate_up.ragged_dot
    assert isinstance(experts, LowPrecisionRaggedDot) and experts.recipe.name == "nvfp4"
    assert model.layers[3].mlp.down.ragged_dot.recipe.name == "bf16"
    lp.apply_recipe(model, "bf16")  # applied again: every expert GEMM in BF16
    assert model.layers[0].mlp.gate_up.ragged_dot.recipe.name == "bf16"


def _trained(tmp_path, token_cache, *overrides):
    plan = resolve(tiny(tmp_path, token_cache, "model.type=moe", *overrides))
    result = run(plan)
    return result, read_metrics(tmp_path)


# FP8-CS and FP8 block run the same grouped GEMM as MXFP8 (tests/gemm/test_ragged_dot.py);
# each training run compiles every window of every expert GEMM (2-4 minutes on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_recipes_train_the_tiny_moe_with_its_balance_in_the_metrics(recipe, tmp_path, token_cache):
    overrides = ["model.num_layers=2", f"precision={recipe}"] + (
        ["precision.last_bf16_layers=1"] if recipe == "nvfp4" else [])
    result, rows = _trained(tmp_path, token_cache, *overrides)
    losses = [m["loss"] for m in rows]
    assert result.step == 8 and np.mean(losses[-3:]) < losses[0] - 0.3, losses
    for m in rows:
        assert m["moe_aux_loss"] > 0 and m["moe_z_loss"] == 0
        assert 0 <= m["moe_load_min"] <= 1 <= m["moe_load_max"] <= 8


@pytest.mark.slow  # four MoE forward and backward compiles
def test_scanned_layers_equal_unrolled_ones_with_their_statistics():
    """scan_layers: the runs of equal layers (here layer 0 in BF16 by the policy, then 1-3
    in MXFP8) are scanned, and the logits, routing statistics and gradients are those of
    the unrolled layers."""
    recipe = lp.get_recipe("mxfp8", first_bf16_layers=1, last_bf16_layers=0)
    tokens = jax.random.randint(jax.random.key(2), (2, 32), 0, 384)

    def loss_and_grads(scan):
        model, _ = _model(scan_layers=scan)
        lp.apply_recipe(model, recipe)
        if scan:
            assert model.scanned_runs() == [(1, 4)]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits, extras = nnx.merge(graphdef, params, rest)(tokens)
            return jnp.mean(logits ** 2) + extras["aux_loss"], extras

        (value, extras), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, extras, grads

    scanned, unrolled = loss_and_grads(True), loss_and_grads(False)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    assert set(scanned[1]) == {"aux_loss", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min"}


@pytest.mark.parametrize("override, message", [
    ("model.moe_router_topk=9", "model: model.moe_router_topk=9 must be between 1 and model.num_experts=8"),
    ("model.num_experts=1", "model: model.type=moe needs model.num_experts >= 2, got 1"),
    ("model.remat=mlp", "model: model.remat=mlp rebuilds a dense MLP block"),
])
def test_bad_shapes_are_one_line(override, message, tmp_path, token_cache):
    with pytest.raises(UserError) as e:
        resolve(tiny(tmp_path, token_cache, "model.type=moe", override), check_files=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_flops_count_the_active_experts_only():
    cfg = moe.preset("qwen3_30b_a3b")
    dense_experts = cfg.replace(moe_router_topk=cfg.num_experts)
    active = moe.flops_per_token(cfg, 4096)
    assert moe.flops_per_token(dense_experts, 4096) > 5 * active
    # About 3.3B active parameters (Qwen3-30B-A3B's card says 3.3B), 6 FLOPs each, plus attention.
    assert 6 * 3.0e9 < active - 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 4096 < 6 * 3.6e9


def test_the_scorer_reads_the_moe_models_logits():
    """lm-eval scoring (lp_jax.evaluation) takes the logits of a model returning extras."""
    from lp_jax.evaluation.scorer import continuation_logprobs, make_scoring_step
    model, cfg = _model()
    tokens = (jnp.arange(32, dtype=jnp.int32) * 7 % cfg.vocab_size).reshape(2, 16)
    targets = jnp.roll(tokens, -1, axis=1)[:, None, :]
    mask = jnp.ones(targets.shape, bool).at[:, :, -1].set(False)
    got = make_scoring_step(model)(tokens, targets, mask)
    want = continuation_logprobs(model(tokens)[0], targets, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
