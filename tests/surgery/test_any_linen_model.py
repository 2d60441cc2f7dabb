"""apply_recipe_linen on a Linen model lp_jax did not write: nn.DenseGeneral for qkv (two
output axes), nn.Einsum over heads and head_dim, a GPT-2-style module calling
jax.lax.dot_general on its transposed kernel itself, nn.Dense, blocks named layers_0 ...
layers_N, and a tied embedding as the head. Every recipe: each GEMM kind equals
lp.dot_general's call on the same operands, bit for bit, forward and backward; the parameter
tree is the model's; the layer policy lands on the right blocks; bad input is one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import lp_jax as lp

RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")
D, HEADS, HEAD_DIM, FFN, VOCAB = 128, 2, 64, 256, 64
DN = (((2,), (0,)), ((), ()))


class Conv1D(nn.Module):
    """Hugging Face's Flax GPT-2 way: the kernel [out, in], transposed and cast, then
    jax.lax.dot_general called by the module itself."""

    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
        return jax.lax.dot_general(x, jnp.asarray(kernel.T, jnp.bfloat16), DN)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        qkv = nn.DenseGeneral((3, HEADS, HEAD_DIM), use_bias=False, dtype=jnp.bfloat16, name="qkv")(x)
        q, k, v = jnp.moveaxis(qkv, 2, 0)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.Einsum((HEADS, HEAD_DIM, D), "BLHK,HKD->BLD", use_bias=False, dtype=jnp.bfloat16,
                          name="out")(attn)
        return x + nn.Dense(D, use_bias=False, dtype=jnp.bfloat16, name="proj")(
            jax.nn.gelu(Conv1D(FFN, name="fc")(x)))


class GPT(nn.Module):
    num_layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        wte = nn.Embed(VOCAB, D, dtype=jnp.bfloat16, name="wte")
        x = wte(tokens)
        for i in range(self.num_layers):
            x = Block(name=f"layers_{i}")(x)
        return wte.attend(x)  # the tied head


TOKENS = jax.random.randint(jax.random.key(0), (2, 64), 0, VOCAB)


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


# One module each, its input, and the lp.dot_general call it must equal (kernel: the parameter).
def _cases(dg):
    return [
        (nn.Dense(FFN, use_bias=False, dtype=jnp.bfloat16), _x((2, 64, D)),
         lambda x, k: dg(x, k, DN)),
        (nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, dtype=jnp.bfloat16), _x((2, 64, HEADS, HEAD_DIM)),
         lambda x, k: dg(x, k, (((2, 3), (0, 1)), ((), ())))),
        (nn.Einsum((HEADS, HEAD_DIM, D), "BLHK,HKD->BLD", use_bias=False, dtype=jnp.bfloat16),
         _x((2, 64, HEADS, HEAD_DIM)),
         lambda x, k: jnp.einsum("BLHK,HKD->BLD", x, k, preferred_element_type=x.dtype, _dot_general=dg)),
        (Conv1D(FFN), _x((2, 64, D)), lambda x, k: dg(x, jnp.asarray(k.T, jnp.bfloat16), DN)),
    ]


@pytest.mark.parametrize("name", RECIPES)
def test_each_linen_gemm_is_lp_dot_general_bit_for_bit(name):
    recipe = lp.get_recipe(name, policy="F0L0")
    for module, x, reference in _cases(lp.dot_general(recipe)):
        params = module.init(jax.random.key(2), x)
        quantized = lp.apply_recipe_linen(module, recipe)
        kernel = params["params"]["kernel"]
        dy = _x(jax.eval_shape(module.apply, params, x).shape, seed=3)

        def vjp(fn, x, k):
            y, pullback = jax.vjp(fn, x, k)
            return (y, *pullback(dy))

        got = jax.jit(lambda x, k: vjp(lambda x, k: quantized.apply({"params": {"kernel": k}}, x), x, k))(x, kernel)
        want = jax.jit(lambda x, k: vjp(reference, x, k))(x, kernel)
        kind = type(module).__name__
        for what, g, w in zip(("output", "input gradient", "kernel gradient"), got, want):
            assert g.dtype == w.dtype, (kind, what)
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=f"{kind} {what}")
        assert got[2].dtype == jnp.float32  # the FP32 weight gradient
        report = lp.linen_report(quantized)
        assert list(report.quantized) == [""] or list(report.quantized) == [module.name or ""], report


@pytest.mark.slow
def test_layer_policy_lands_on_the_right_blocks_and_the_tree_is_the_models():
    model = GPT()
    params = model.init(jax.random.key(1), TOKENS)
    quantized = lp.apply_recipe_linen(model, lp.get_recipe("nvfp4", policy="F1L1"))
    assert jax.tree.structure(quantized.init(jax.random.key(1), TOKENS)) == jax.tree.structure(params)
    report = lp.linen_report(quantized)
    assert (report.layer_container, report.num_layers) == ("layers", 4)
    gemms = ("qkv", "out", "fc", "proj")
    assert sorted(report.quantized) == sorted(f"layers_{i}/{g}" for i in (1, 2) for g in gemms)
    assert sorted(report.bf16_by_policy) == sorted(f"layers_{i}/{g}" for i in (0, 3) for g in gemms)
    assert report.not_selected == ["wte"] and report.fp32_weight_gradients == []  # attend: not swappable
    assert "container 'layers'" in str(report).splitlines()[0]
    grads = jax.jit(jax.grad(lambda p: quantized.apply(p, TOKENS).astype(jnp.float32).mean()))(params)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    # Quantized, it differs from the model; in BF16 with FP32 weight gradients it equals it.
    assert not np.array_equal(quantized.apply(params, TOKENS), model.apply(params, TOKENS))
    bf16 = lp.apply_recipe_linen(model, "bf16")
    np.testing.assert_array_equal(np.asarray(bf16.apply(params, TOKENS), np.float32),
                                  np.asarray(model.apply(params, TOKENS), np.float32))


def _refused(model, match, **kw):
    with pytest.raises(ValueError, match=match) as info:
        quantized = lp.apply_recipe_linen(model, kw.pop("recipe", "mxfp8"), **kw)
        quantized.init(jax.random.key(1), TOKENS)
    # One line; JAX appends its traceback note below an error raised under init (an API of its).
    assert "\n" not in str(info.value).split("\n--------------------\n")[0]


def test_bad_input_is_one_line():
    model = GPT()
    _refused(model, r"include rule 'attn' matches no GEMM; the model's GEMMs are layers_0/qkv", include="attn")
    _refused(model, r"include rule 'wte' matches only the embedding or LM head \(wte \(nn.Embed.attend: a tied "
             r"embedding used as a head\)\)", include="wte")
    _refused(model, r"exclude rule 'nope' matches no GEMM", exclude="nope")
    _refused(model, r"selected no GEMM to run mxfp8: saw 17 GEMMs .*exclude=layers", exclude="layers")
    _refused(model, r"layers='blocks' names no layer container of this model; containers found: 'layers'",
             layers="blocks")
    _refused(model, r"keeps more layers in BF16 than the model has \(4\)", recipe=lp.get_recipe("nvfp4", policy="F3L3"))

    class Convolved(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, D, name="embed")(tokens)
            x = nn.Conv(D, (3,), name="conv")(x)
            return nn.Dense(VOCAB, name="lm_head")(x)

    _refused(Convolved(), r"include rule 'conv' matches no GEMM; it matches only modules that hold no GEMM "
             r"apply_recipe_linen can swap: conv \(Conv\)", include="conv")
    _refused(Convolved(), r"selected no GEMM to run mxfp8: saw 1 GEMMs \(lm_head \(nn.Dense\)\)")

    class Outer(nn.Module):
        inner: nn.Module

        def __call__(self, tokens):
            return self.inner(tokens)

    with pytest.raises(ValueError, match="called inside another module: apply_recipe_linen the outermost"):
        Outer(lp.apply_recipe_linen(GPT(), "mxfp8")).init(jax.random.key(1), TOKENS)
    with pytest.raises(ValueError, match="takes a flax.linen.Module, not Linear"):
        from flax import nnx
        lp.apply_recipe_linen(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mxfp8")
    with pytest.raises(ValueError, match="the plan is made at the module's first init or apply"):
        lp.linen_report(lp.apply_recipe_linen(GPT(num_layers=2), "fp8_cs"))
