"""What each remat policy keeps for a layer's backward: the activations its VJP holds, in
bytes per token per hidden unit, at the tiny config's shapes in BF16 (XLA attention)."""
import jax.numpy as jnp
import pytest
from flax import nnx

from models import llama
from tests.support.layer_residuals import layer_vjp_leaves

B, L = 3, 64


def _kept_per_token_hidden(remat: str) -> float:
    cfg = llama.preset("tiny", dtype=jnp.bfloat16, remat=remat)
    leaves = layer_vjp_leaves(llama.Llama(cfg, rngs=nnx.Rngs(0)), B, L)
    # Per-token tensors only (the weights have no batch axis).
    kept = [leaf for leaf in leaves if leaf.shape[:1] == (B,)]
    return sum(leaf.nbytes for leaf in kept) / (B * L) / cfg.hidden_size


@pytest.fixture(scope="module")
def kept():
    return {name: _kept_per_token_hidden(name) for name in ("none", "megatron", "elementwise", "full")}


def test_each_policy_keeps_less_than_the_one_before(kept):
    assert kept["none"] > kept["megatron"] > kept["elementwise"] > kept["full"] > 0


def test_elementwise_drops_exactly_the_norm_outputs_and_the_swiglu_product(kept):
    cfg = llama.preset("tiny")
    norm_outputs = 2 * 2  # two RMSNorm outputs, [B, L, D] BF16 each
    swiglu_product = 2 * cfg.intermediate_size / cfg.hidden_size  # [B, L, F] BF16
    assert kept["megatron"] - kept["elementwise"] == pytest.approx(norm_outputs + swiglu_product)


def test_full_keeps_only_the_layer_inputs(kept):
    cfg = llama.preset("tiny")
    x = 2.0  # [B, L, D] BF16
    rope = 2 * 4 * (cfg.head_dim // 2) / cfg.hidden_size  # cos and sin, [B, L, H/2] float32
    mask = L / cfg.hidden_size  # [B, L, L] bool
    assert kept["full"] == pytest.approx(x + rope + mask)
