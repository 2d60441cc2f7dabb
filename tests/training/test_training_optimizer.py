"""Learning-rate schedule, weight-decay mask, clipping order of the AdamW transformation."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lp_jax.training.optimizer import OptimizerSpec, decay_mask, learning_rate_schedule, make_optimizer


def spec(**kw):
    base = dict(peak_lr=6e-4, min_lr=6e-6, init_lr=0.0, warmup_steps=2000, decay_steps=10000,
                decay="cosine", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.033, clip_grad_norm=1.0)
    return OptimizerSpec(**{**base, **kw})


def test_warmup_then_cosine_to_min_lr():
    lr = learning_rate_schedule(spec())
    np.testing.assert_allclose([float(lr(c)) for c in (0, 1000, 2000, 6000, 10000, 12000)],
                               [0.0, 3e-4, 6e-4, (6e-4 + 6e-6) / 2, 6e-6, 6e-6], rtol=1e-5)
    assert float(lr(3000)) > float(lr(4000))  # decaying


@pytest.mark.parametrize("decay, mid", [("linear", (6e-4 + 6e-6) / 2), ("constant", 6e-4)])
def test_other_decays(decay, mid):
    lr = learning_rate_schedule(spec(decay=decay, warmup_steps=0, decay_steps=100))
    np.testing.assert_allclose(float(lr(50)), mid, rtol=1e-5)
    np.testing.assert_allclose(float(lr(0)), 6e-4, rtol=1e-6)


class Tiny(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.norm = nnx.RMSNorm(4, rngs=rngs)
        self.stacked_scale = nnx.Param(jnp.ones((2, 4)))  # not named scale: decayed


def test_weight_decay_only_on_matrices():
    _, params = nnx.split(Tiny(), nnx.Param)
    mask = decay_mask(params)
    flat = {"/".join(str(k.key) for k in path if hasattr(k, "key")): v
            for path, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat == {"linear/bias": False, "linear/kernel": True, "norm/scale": False,
                    "stacked_scale": True}
    # With zero gradients only the decayed parameters move.
    tx = make_optimizer(spec(warmup_steps=0, weight_decay=0.5, clip_grad_norm=0.0))
    state = tx.init(params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
    moved = {k: bool(jnp.any(u != 0)) for k, u in
             zip(flat, jax.tree.leaves(updates))}
    assert moved == flat


def test_clipping_happens_before_adam():
    params = {"w": jnp.ones((3, 3))}
    grads = [{"w": jnp.full((3, 3), 100.0)}, {"w": jnp.full((3, 3), -0.01)}]
    s = spec(warmup_steps=0, decay="constant", weight_decay=0.0, clip_grad_norm=1.0)
    tx = make_optimizer(s)
    reference = optax.adamw(6e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
    st, st_ref = tx.init(params), reference.init(params)
    for g in grads:
        clipped = jax.tree.map(lambda x: x * min(1.0, 1.0 / float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))), g)
        up, st = tx.update(g, st, params)
        up_ref, st_ref = reference.update(clipped, st_ref, params)
        np.testing.assert_allclose(up["w"], up_ref["w"], rtol=1e-5)
