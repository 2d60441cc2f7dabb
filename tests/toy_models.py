"""A small NNX model with the layout apply_recipe expects (layers/<i>/...), for swap tests."""
import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.context import layer_scope


def linear(din, dout, rngs):
    return nnx.Linear(din, dout, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.q_proj = linear(d, d, rngs)
        self.up_proj = linear(d, 2 * d, rngs)
        self.down_proj = linear(2 * d, d, rngs)

    def __call__(self, x):
        h = x + self.q_proj(x)
        return h + self.down_proj(jax.nn.silu(self.up_proj(h)))


class Toy(nnx.Module):
    def __init__(self, num_layers=6, d=32, vocab=64, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.layers = nnx.List([Block(d, rngs) for _ in range(num_layers)])
        self.lm_head = linear(d, vocab, rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            with layer_scope(i):
                x = block(x)
        return self.lm_head(x)


class StackedToy(nnx.Module):
    """The same network with its blocks stacked by nnx.vmap and run by nnx.scan."""

    def __init__(self, num_layers=6, d=32, vocab=64, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(d, rngs)

        self.layers = make(rngs)
        self.lm_head = linear(d, vocab, rngs)
        self.num_layers = num_layers

    def __call__(self, tokens):
        x = self.embed(tokens)

        @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)
        def run(block, x, i):
            with layer_scope(i):
                return block(x)

        x = run(self.layers, x, jnp.arange(self.num_layers))
        return self.lm_head(x)


def loss_fn(model, tokens):
    logits = model(tokens).astype(jnp.float32)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
