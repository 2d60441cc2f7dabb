"""Toy models for tests, imported as ``from tests.support.toy_models import ...``.

- ``Toy`` / ``StackedToy``: the layout apply_recipe expects (layers/<i>/...), unrolled and
  stacked (nnx.vmap + nnx.scan), for the swap and compiled-quantization tests.
- ``ToyLM`` with ``setup`` and ``batch``: a tiny language model with the Llama call
  signature on a one-device mesh, for the train-step and checkpoint tests.
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax import context
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import state_shardings
from lp_jax.training import state as state_lib
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.step import StepSpec
from models.layer_scope import layer_scope


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


LINEARS_OF_BLOCK = ("q_proj", "up_proj", "down_proj")


def unrolled_like(stacked: StackedToy) -> Toy:
    """A Toy holding the StackedToy's weights, layer by layer."""
    unrolled = Toy(num_layers=stacked.num_layers, d=stacked.embed.embedding.shape[1],
                   vocab=stacked.embed.embedding.shape[0])
    for i, block in enumerate(unrolled.layers):
        for name in LINEARS_OF_BLOCK:
            getattr(block, name).kernel.set_value(getattr(stacked.layers, name).kernel[i])
    unrolled.embed.embedding.set_value(stacked.embed.embedding[...])
    unrolled.lm_head.kernel.set_value(stacked.lm_head.kernel[...])
    return unrolled


def loss_fn(model, tokens):
    logits = model(tokens).astype(jnp.float32)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


# The language-model toy of the train-step and checkpoint tests: the Llama call signature
# (tokens, positions, segment_ids) without waiting for (or depending on) models.llama.
LM_VOCAB, LM_SEQ = 32, 8


class ToyLM(nnx.Module):
    def __init__(self, rngs, noisy=False):
        self.embed = nnx.Embed(LM_VOCAB, 16, rngs=rngs)
        self.hidden = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, LM_VOCAB, rngs=rngs)
        self.noisy = noisy  # draws from the stochastic-rounding key, like a quantized GEMM

    def __call__(self, tokens, positions=None, segment_ids=None):
        x = self.embed(tokens) + 0.01 * positions[..., None] + 0.001 * segment_ids[..., None]
        x = jax.nn.gelu(self.hidden(x))
        if self.noisy:
            x = x + 0.01 * jax.random.normal(context.site_key(), x.shape)
        return self.head(self.norm(x))


def opt_spec(**kw):
    base = dict(peak_lr=1e-2, min_lr=1e-3, init_lr=0.0, warmup_steps=1, decay_steps=50,
                decay="cosine", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, clip_grad_norm=1.0)
    return OptimizerSpec(**{**base, **kw})


def setup(accum=1, noisy=False, seed=0, model=None, **kw):
    """(graphdef, StepSpec, state) for the toy model (or ``model(rngs)``) on a one-device mesh."""
    mesh = make_mesh(1, 1)
    spec = StepSpec(opt_spec(**kw), accum, mesh)
    tx = make_optimizer(spec.optimizer)
    build = (lambda: model(nnx.Rngs(seed))) if model else (lambda: ToyLM(nnx.Rngs(seed), noisy=noisy))
    abstract = nnx.eval_shape(build)
    graphdef, params, rest = state_lib.split_model(abstract)
    target = state_lib.abstract_state((graphdef, params, rest), tx, seed)
    state = state_lib.init_state(build, tx, seed, state_shardings(target, mesh))
    return graphdef, spec, state


def batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, LM_VOCAB, (n, LM_SEQ + 1))
    return {"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "segment_ids": np.ones((n, LM_SEQ), np.int32),
            "positions": np.tile(np.arange(LM_SEQ, dtype=np.int32), (n, 1)),
            "loss_mask": np.ones((n, LM_SEQ), bool)}
