"""The custom-VJP pieces equal autodiff of the plain float32 formulas: outputs bit for bit,
gradients to float32 rounding; their residuals hold nothing in float32 of the activations'
size when the inputs are BF16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.activation_vjp import rms_norm, rope, swiglu

F32 = jnp.float32


def plain_rms_norm(x, scale, eps, out_dtype):
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(F32)).astype(out_dtype)


def plain_rope(x, cos, sin):
    x32 = x.astype(F32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def plain_swiglu(gate, up):
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(gate.dtype)


def _inputs(dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (2, 8, 64), F32).astype(dtype)
    scale = 1.0 + 0.1 * jax.random.normal(k[1], (64,), F32)
    q = jax.random.normal(k[2], (2, 8, 4, 16), F32).astype(dtype)
    angles = jax.random.uniform(k[3], (2, 8, 8), F32, 0, 6.3)
    gate = (3 * jax.random.normal(k[4], (2, 8, 96), F32)).astype(dtype)
    up = jax.random.normal(k[5], (2, 8, 96), F32).astype(dtype)
    return x, scale, q, jnp.cos(angles), jnp.sin(angles), gate, up


CASES = {
    "rms_norm": (lambda x, s, *_: rms_norm(x, s, 1e-5, x.dtype),
                 lambda x, s, *_: plain_rms_norm(x, s, 1e-5, x.dtype), (0, 1)),
    "rope": (lambda x, s, q, c, sn, *_: rope(q, c, sn),
             lambda x, s, q, c, sn, *_: plain_rope(q, c, sn), (2,)),
    "swiglu": (lambda *a: swiglu(a[5], a[6]), lambda *a: plain_swiglu(a[5], a[6]), (5, 6)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_equal_autodiff(name, dtype):
    ours, plain, argnums = CASES[name]
    args = _inputs(dtype)
    np.testing.assert_array_equal(np.asarray(ours(*args), np.float32), np.asarray(plain(*args), np.float32))
    # A cotangent that is not all ones: a weighted sum of the output.
    weights = jax.random.normal(jax.random.key(7), ours(*args).shape, F32)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(F32) * weights)

    got = jax.grad(loss(ours), argnums=argnums)(*args)
    want = jax.grad(loss(plain), argnums=argnums)(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


def _residual_dtypes(f, *args):
    """dtypes and shapes of what the linearized function keeps for its backward."""
    _, vjp = jax.vjp(f, *args)
    return [(leaf.dtype, leaf.shape) for leaf in jax.tree.leaves(vjp)]


def test_bf16_inputs_keep_no_float32_activations():
    x, scale, q, cos, sin, gate, up = _inputs(jnp.bfloat16)
    for f, args, size in [(lambda x, s: rms_norm(x, s, 1e-5, x.dtype), (x, scale), x.size),
                          (swiglu, (gate, up), gate.size), (lambda q: rope(q, cos, sin), (q,), q.size)]:
        big_f32 = [s for d, s in _residual_dtypes(f, *args) if d == F32 and np.prod(s) >= size]
        assert not big_f32, big_f32
    # Autodiff of the plain formulas does keep some (the saving is real).
    kept = _residual_dtypes(plain_swiglu, gate, up)
    assert any(d == F32 and np.prod(s) >= gate.size for d, s in kept)
