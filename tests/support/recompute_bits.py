"""Prints, per case, whether a recompute leaves a 1-layer tiny Llama's loss and every
gradient bit for bit the same: `<recipe> <remat> <equal>`. The first argument says which:
``product`` (recompute_mlp_product off and on, at the case's remat) or ``mlp`` (remat
``none`` against the case's remat, which rebuilds the MLP block). Run it with
--xla_allow_excess_precision=false (tests/models/test_mlp_product_recompute.py says why)."""
import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.recipes import get_recipe
from lp_jax.surgery.swap import apply_recipe
from models import llama


def model(recipe: str, recompute: bool, remat: str) -> llama.Llama:
    cfg = llama.preset("tiny", dtype=jnp.bfloat16, num_layers=1, remat=remat,
                       recompute_mlp_product=recompute)
    m = llama.Llama(cfg, rngs=nnx.Rngs(0))
    if recipe != "bf16":  # every layer quantized: the recipe's own policy would keep some BF16
        apply_recipe(m, dataclasses.replace(get_recipe(recipe), first_bf16_layers=0, last_bf16_layers=0))
    return m


def loss_and_grads(m):
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, m.config.vocab_size)
    return jax.jit(nnx.value_and_grad(lambda m: m(tokens).astype(jnp.float32).mean()))(m)


def pair(what: str, recipe: str, remat: str):
    if what == "product":
        return model(recipe, False, remat), model(recipe, True, remat)
    return model(recipe, False, "none"), model(recipe, False, remat)


if __name__ == "__main__":
    what = sys.argv[1]
    for case in sys.argv[2:]:
        recipe, remat = case.split(":")
        (l0, g0), (l1, g1) = (loss_and_grads(m) for m in pair(what, recipe, remat))
        equal = bool(l0 == l1) and all(bool(jnp.array_equal(a, b)) for a, b in
                                       zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True))
        print(recipe, remat, equal, flush=True)
