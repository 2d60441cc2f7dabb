"""The recipes on models nobody here wrote, installed from packages (the `models` extra):
Hugging Face transformers' Linen GPT-2 (its FlaxConv1D calls jax.lax.dot_general on a
transposed kernel) and Llama (nn.Dense), through apply_recipe_linen, and MaxText's NNX
DenseGeneral (lax.dot_general on its own kernel, contractions over several axes), through
apply_recipe. Small configs, random weights, nothing downloaded. Each selected GEMM equals
lp.dot_general's call on the operands the module passes it, bit for bit; the layer policy
lands on the right blocks; a short training run lowers the loss."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import lp_jax as lp

transformers = pytest.importorskip("transformers")
linears = pytest.importorskip("maxtext.layers.linears")

RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")
VOCAB, D, FFN, HEADS, LAYERS = 128, 128, 256, 2, 4
DN = (((2,), (0,)), ((), ()))


def _hf(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "gpt2":
            config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=LAYERS,
                                             n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return transformers.FlaxGPT2LMHeadModel(config, seed=0, dtype=jnp.bfloat16)
        # Flax Llama's rotary table is cut at max_position_embeddings: keep it >= 2 * head_dim.
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          num_key_value_heads=1, max_position_embeddings=128)
        return transformers.FlaxLlamaForCausalLM(config, seed=0, dtype=jnp.bfloat16)


IDS = jax.random.randint(jax.random.key(0), (2, 64), 0, VOCAB)
ARGS = (IDS, jnp.ones_like(IDS), jnp.broadcast_to(jnp.arange(64), IDS.shape))


def _reference(module, params, x, dg):
    """What the Hugging Face module's GEMM is, on its own operands, with lp.dot_general."""
    if type(module).__name__ == "FlaxConv1D":  # kernel [out, in], transposed and cast by the module
        y = dg(jnp.asarray(x, module.dtype), jnp.asarray(params["kernel"].T, module.dtype), DN)
        return y + jnp.asarray(params["bias"], module.dtype) if module.use_bias else y
    assert isinstance(module, nn.Dense) and not module.use_bias
    return dg(jnp.asarray(x, module.dtype), params["kernel"], DN)


def _gemm_calls(quantized, params, paths):
    """{path: (module, its params, input, output)} of one forward pass, for the given paths."""
    calls = {}

    def spy(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        path = "/".join(context.module.path) or context.module.name
        if context.method_name == "__call__" and path in paths and not isinstance(out, jax.core.Tracer):
            calls[path] = (context.module, context.module.variables["params"], args[0], out)
        return out

    with nn.intercept_methods(spy):
        quantized.apply({"params": params}, *ARGS)
    return calls


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "nvfp4" else pytest.mark.slow)
                                  for n in RECIPES])
def test_hugging_face_linen_models_every_gemm_bit_for_bit(model, name):
    hf = _hf(model)
    recipe = lp.get_recipe(name, policy="F0L1")
    quantized = lp.apply_recipe_linen(hf.module, recipe)
    logits = quantized.apply({"params": hf.params}, *ARGS).logits
    report = lp.linen_report(quantized)
    blocks = {"gpt2": "transformer/h", "llama": "model/layers"}[model]
    per_block = {"gpt2": 4, "llama": 7}[model]
    assert (report.layer_container, report.num_layers) == (blocks, LAYERS)
    assert len(report.quantized) == 3 * per_block and len(report.bf16_by_policy) == per_block
    assert all(p.startswith(f"{blocks}/3/") for p in report.bf16_by_policy)  # L1: the last block
    assert report.fp32_weight_gradients == ["lm_head"]  # never quantized
    want = {**{p: lp.get_recipe(name) for p in report.quantized},
            **{p: lp.get_recipe("bf16") for p in report.bf16_by_policy}}
    calls = _gemm_calls(quantized, hf.params, set(want))
    assert set(calls) == set(want)
    for path, (module, params, x, y) in calls.items():
        ref = _reference(module, params, x, lp.dot_general(want[path]))
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32), err_msg=path)
    if name != "bf16":
        assert not np.array_equal(logits, hf.module.apply({"params": hf.params}, *ARGS).logits)


@pytest.mark.parametrize("name", RECIPES)
def test_hugging_face_conv1d_forward_and_backward_bit_for_bit(name):
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxConv1D

    recipe = lp.get_recipe(name, policy="F0L0")
    module = FlaxConv1D(FFN, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 64, D)).astype(jnp.bfloat16)
    params = module.init(jax.random.key(2), x)["params"]
    quantized = lp.apply_recipe_linen(module, recipe)
    dy = jax.random.normal(jax.random.key(3), (2, 64, FFN)).astype(jnp.bfloat16)

    def vjp(fn):
        y, pullback = jax.vjp(fn, x, params)
        return y, *pullback(dy)

    got = jax.jit(lambda: vjp(lambda x, p: quantized.apply({"params": p}, x)))()
    want = jax.jit(lambda: vjp(lambda x, p: _reference(module, p, x, lp.dot_general(recipe))))()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


class MaxTextBlock(nnx.Module):
    """Attention-free block of MaxText's NNX DenseGeneral: a projection to (heads, head_dim),
    one contracting both back (axis=(-2, -1)), and an MLP."""

    def __init__(self, rngs):
        kw = dict(weight_dtype=jnp.float32, dtype=jnp.bfloat16, rngs=rngs)
        self.heads = linears.DenseGeneral(D, (HEADS, D // HEADS), **kw)
        self.merge = linears.DenseGeneral((HEADS, D // HEADS), D, axis=(-2, -1), **kw)
        self.wi = linears.DenseGeneral(D, FFN, **kw)
        self.wo = linears.DenseGeneral(FFN, D, **kw)

    def __call__(self, x):
        x = x + self.merge(jax.nn.gelu(self.heads(x)))
        return x + self.wo(jax.nn.gelu(self.wi(x)))


class MaxTextModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.layers = nnx.List([MaxTextBlock(rngs) for _ in range(LAYERS)])
        self.lm_head = nnx.Linear(D, VOCAB, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


@pytest.mark.parametrize("name", RECIPES)
def test_maxtext_nnx_dense_general_forward_and_backward_bit_for_bit(name):
    model = MaxTextModel(nnx.Rngs(0))
    report = lp.apply_recipe(model, lp.get_recipe(name, policy="F1L0"))
    assert (report.layer_container, report.num_layers) == ("layers", LAYERS)
    assert sorted(report.bf16_by_policy) == [f"layers/0/{g}" for g in ("heads", "merge", "wi", "wo")]
    assert len(report.quantized) == 4 * (LAYERS - 1)
    assert report.fp32_weight_gradients == ["lm_head"]
    block = model.layers[1]
    dg = lp.dot_general(lp.get_recipe(name))
    x = jax.random.normal(jax.random.key(1), (2, 64, D)).astype(jnp.bfloat16)
    for module, x, dn in ((block.wi, x, DN),
                          (block.merge, jax.random.normal(jax.random.key(2), (2, 64, HEADS, D // HEADS)
                                                          ).astype(jnp.bfloat16), (((2, 3), (0, 1)), ((), ())))):
        graphdef, state = nnx.split(module)
        kernel = state["kernel"][...]
        dy = jnp.ones(jax.eval_shape(lambda: module(x)).shape, jnp.bfloat16)

        def vjp(fn, params):
            y, pullback = jax.vjp(fn, x, params)
            dx, dparams = pullback(dy)
            return y, dx, *jax.tree.leaves(dparams)

        got = jax.jit(lambda st: vjp(lambda x, st: nnx.merge(graphdef, st)(x), st))(state)
        want = jax.jit(lambda k: vjp(lambda x, k: dg(x, k.astype(jnp.bfloat16), dn), k))(kernel)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _train(loss_of, params, steps):
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses


def _xent(logits):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), IDS[:, 1:]).mean()


@pytest.mark.slow
def test_short_training_runs_lower_the_loss():
    hf = _hf("gpt2")
    quantized = lp.apply_recipe_linen(hf.module, lp.get_recipe("nvfp4", policy="F0L1"))
    losses = _train(lambda p: _xent(quantized.apply({"params": p}, *ARGS).logits), hf.params, 12)
    assert losses[-1] < losses[0] - 0.5, losses

    model = MaxTextModel(nnx.Rngs(0))
    lp.apply_recipe(model, lp.get_recipe("mxfp8", policy="F1L0"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    losses = _train(lambda p: _xent(nnx.merge(graphdef, p, rest)(IDS)), params, 12)
    assert losses[-1] < losses[0] - 0.5, losses
