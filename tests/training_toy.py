"""A toy language model with the Llama call signature, for tests of the step and the
checkpoints that must not wait for (or depend on) models.llama."""
import jax
import numpy as np
from flax import nnx

from lp_jax import context
from lp_jax.training import state as state_lib
from lp_jax.training.mesh import make_mesh
from lp_jax.training.partitioning import state_shardings
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.step import StepSpec

VOCAB, SEQ = 32, 8


class ToyLM(nnx.Module):
    def __init__(self, rngs, noisy=False):
        self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
        self.hidden = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, VOCAB, rngs=rngs)
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


def setup(accum=1, noisy=False, seed=0, **kw):
    """(graphdef, StepSpec, state) for the toy model on a one-device mesh."""
    mesh = make_mesh(1, 1)
    spec = StepSpec(opt_spec(**kw), accum, mesh)
    tx = make_optimizer(spec.optimizer)
    build = lambda: ToyLM(nnx.Rngs(seed), noisy=noisy)
    abstract = nnx.eval_shape(build)
    graphdef, params, rest = state_lib.split_model(abstract)
    target = state_lib.abstract_state((graphdef, params, rest), tx, seed)
    state = state_lib.init_state(build, tx, seed, state_shardings(target, mesh))
    return graphdef, spec, state


def batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, SEQ + 1))
    return {"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "segment_ids": np.ones((n, SEQ), np.int32),
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (n, 1)),
            "loss_mask": np.ones((n, SEQ), bool)}
