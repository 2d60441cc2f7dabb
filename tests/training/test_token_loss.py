"""The loss's custom VJP equals autodiff of the plain float32 formula, and keeps no float32
copy of the logits for the backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.training.token_loss import token_nll


def _reference(logits, targets, mask):
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum((log_z - target) * mask), jnp.sum(mask)


def _inputs(dtype, vocab=97):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = (4 * jax.random.normal(k1, (3, 11, vocab))).astype(dtype)
    targets = jax.random.randint(k2, (3, 11), 0, vocab)
    mask = jax.random.bernoulli(k3, 0.8, (3, 11))
    return logits, targets, mask


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_and_gradient_match_autodiff(dtype):
    logits, targets, mask = _inputs(dtype)
    nll, count = token_nll(logits, targets, mask)
    ref_nll, ref_count = _reference(logits, targets, mask)
    assert float(count) == float(ref_count)
    np.testing.assert_allclose(float(nll), float(ref_nll), rtol=1e-6)
    grad = jax.grad(lambda x: 0.37 * token_nll(x, targets, mask)[0])(logits)
    ref = jax.grad(lambda x: 0.37 * _reference(x, targets, mask)[0])(logits)
    assert grad.dtype == logits.dtype
    g, r = np.asarray(grad, np.float32), np.asarray(ref, np.float32)
    # float32: summation order only; BF16: one rounding of nearly equal float32 values.
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())
    assert np.all(g[~np.asarray(mask)] == 0)  # masked tokens get no gradient


def test_the_backward_keeps_the_logits_in_their_dtype():
    logits, targets, mask = _inputs(jnp.bfloat16, vocab=4096)
    _, vjp = jax.vjp(lambda x: token_nll(x, targets, mask)[0], logits)
    kept = [leaf for leaf in jax.tree.leaves(vjp) if getattr(leaf, "size", 0) >= logits.size]
    assert kept and all(leaf.dtype == jnp.bfloat16 for leaf in kept)
    _, ref_vjp = jax.vjp(lambda x: _reference(x, targets, mask)[0], logits)
    assert any(leaf.dtype == jnp.float32 and leaf.size >= logits.size for leaf in jax.tree.leaves(ref_vjp))
