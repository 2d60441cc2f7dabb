"""recompute_mlp_product: the backward rebuilds the SwiGLU product (and a quantized down
projection's copies of it) from gate and up instead of keeping it. The loss and every
gradient are the same bits; the layer keeps exactly the product's bytes less; a run's
default turns it on where the kept copy would be a quantized one."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from lp_jax.config.yaml_io import load_config
from lp_jax.recipes import get_recipe
from lp_jax.surgery.swap import apply_recipe
from lp_jax.training.validate import resolve
from models import llama

B, L = 2, 40  # 80 tokens: no weight's size is a multiple of it at the tiny shapes


def _model(recipe: str, recompute: bool, **kw) -> llama.Llama:
    cfg = llama.preset("tiny", dtype=jnp.bfloat16, num_layers=1, recompute_mlp_product=recompute, **kw)
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    if recipe != "bf16":  # every layer quantized: the recipe's own policy would keep some BF16
        apply_recipe(model, dataclasses.replace(get_recipe(recipe), first_bf16_layers=0,
                                                last_bf16_layers=0))
    return model


def _loss_and_grads(model):
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, model.config.vocab_size)
    return jax.jit(nnx.value_and_grad(lambda m: m(tokens).astype(jnp.float32).mean()))(model)


@pytest.mark.parametrize("recipe,remat", [("bf16", "none"), ("fp8_cs", "megatron"), ("nvfp4", "none")])
def test_same_loss_and_gradients_bit_for_bit(recipe, remat):
    kept, recomputed = (_loss_and_grads(_model(recipe, r, remat=remat)) for r in (False, True))
    assert kept[0] == recomputed[0]
    for a, b in zip(jax.tree.leaves(kept[1]), jax.tree.leaves(recomputed[1]), strict=True):
        assert jnp.array_equal(a, b)


def _per_token_residuals(recipe: str, recompute: bool) -> list[tuple]:
    """(shape, dtype) of each per-token tensor layer 0's VJP keeps."""
    model = _model(recipe, recompute)
    graphdef, params, rest = nnx.split(model.layers[0], nnx.Param, ...)
    body = model._layer_fn(graphdef)
    x = jnp.ones((B, L, model.config.hidden_size), jnp.bfloat16)
    rope = llama.rope_tables(jnp.broadcast_to(jnp.arange(L), (B, L)), model.config)
    mask = llama.causal_document_mask(None, B, L)
    _, vjp = jax.vjp(lambda p, x: body(p, rest, x, jnp.int32(0), rope, mask, None), params, x)
    return sorted((leaf.shape, leaf.dtype.name) for leaf in jax.tree.leaves(vjp)
                  if hasattr(leaf, "shape") and leaf.size and leaf.size % (B * L) == 0)


@pytest.mark.parametrize("recipe,dtype", [("bf16", "bfloat16"), ("fp8_cs", "float8_e4m3fn")])
def test_the_layer_keeps_exactly_the_products_bytes_less(recipe, dtype):
    kept, recomputed = _per_token_residuals(recipe, False), _per_token_residuals(recipe, True)
    f = llama.preset("tiny").intermediate_size
    dropped = list(kept)
    for item in recomputed:
        dropped.remove(item)  # nothing new is kept
    sizes = [(int(jnp.prod(jnp.array(shape))), name) for shape, name in dropped]
    assert sizes == [(B * L * f, dtype)]  # the product (BF16) or its FP8 copy, and nothing else


def test_a_run_recomputes_where_it_quantizes_unless_told(tmp_path):
    def plan(*keys):
        return resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", *keys]),
                       check_files=False).model_config.recompute_mlp_product
    assert plan() is False  # BF16 keeps the product, as Megatron's layer does
    assert plan("precision=fp8_cs") is True
    assert plan("precision=nvfp4", "model.recompute_mlp_product=false") is False
    assert plan("model.recompute_mlp_product=true") is True
    with pytest.raises(ValueError, match="recompute_mlp_product must be true or false"):
        llama.preset("tiny", recompute_mlp_product="yes")
