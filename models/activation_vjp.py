"""RMSNorm, RoPE and SwiGLU with float32 arithmetic inside and only compute-dtype tensors
kept for the backward.

Left to autodiff, each piece's float32 upcasts are residuals: the backward of
``silu(gate.astype(f32)) * up.astype(f32)`` keeps float32 copies of gate and up ([tokens, F]
each), RMSNorm keeps its float32 input and normalized input ([tokens, D]). A custom VJP per
piece keeps only what the backward cannot do without, in the dtype it arrived in (the
compute dtype: BF16 in training), and recomputes the float32 intermediates there: a few
elementwise operations that fuse into the backward's own kernels. The forward is the same
operations as before, so outputs are unchanged bit for bit; gradients equal autodiff's to
float32 rounding (tests/models/test_activation_vjp.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


# ---- RMSNorm: y = x / rms(x) * scale ----

def _rms_parts(x, eps):
    x32 = x.astype(F32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32, inv_rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, eps: float, out_dtype):
    x32, inv_rms = _rms_parts(x, eps)
    return (x32 * inv_rms * scale.astype(F32)).astype(out_dtype)


def _rms_norm_fwd(x, scale, eps, out_dtype):
    return rms_norm(x, scale, eps, out_dtype), (x, scale)


def _rms_norm_bwd(eps, out_dtype, saved, g):
    x, scale = saved
    x32, inv_rms = _rms_parts(x, eps)
    normed = x32 * inv_rms
    g32 = g.astype(F32)
    gs = g32 * scale.astype(F32)
    # d/dx of x * r(x): r * (gs - normed * mean(gs * normed)), r = 1 / rms(x).
    dx = inv_rms * (gs - normed * jnp.mean(gs * normed, axis=-1, keepdims=True))
    dscale = jnp.sum((g32 * normed).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# ---- RoPE: rotate the pairs (i, i + H/2) by the position's angles ----

def _rotate(x32, cos, sin):
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@jax.custom_vjp
def rope(x_BxLxNxH, cos_BxLxH2, sin_BxLxH2):
    cos, sin = cos_BxLxH2[:, :, None, :], sin_BxLxH2[:, :, None, :]
    return _rotate(x_BxLxNxH.astype(F32), cos, sin).astype(x_BxLxNxH.dtype)


def _rope_fwd(x, cos, sin):
    # The rotation is linear in x: its backward needs the angles only, not x. A zero-size
    # stand-in carries x's dtype to the backward.
    return rope(x, cos, sin), (cos, sin, jnp.zeros((0,), x.dtype))


def _rope_bwd(saved, g):
    cos_BxLxH2, sin_BxLxH2, like_x = saved
    cos, sin = cos_BxLxH2[:, :, None, :], sin_BxLxH2[:, :, None, :]
    # The transpose of a rotation is the rotation by the opposite angle.
    dx = _rotate(g.astype(F32), cos, -sin).astype(like_x.dtype)
    # The tables come from integer positions: no gradient flows to them.
    return dx, jnp.zeros_like(cos_BxLxH2), jnp.zeros_like(sin_BxLxH2)


rope.defvjp(_rope_fwd, _rope_bwd)


# ---- SwiGLU's gating: silu(gate) * up ----

@jax.custom_vjp
def swiglu(gate, up):
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(saved, g):
    gate, up = saved
    g32, gate32, up32 = g.astype(F32), gate.astype(F32), up.astype(F32)
    sig = jax.nn.sigmoid(gate32)
    silu = gate32 * sig
    dgate = g32 * up32 * sig * (1.0 + gate32 * (1.0 - sig))
    return dgate.astype(gate.dtype), (g32 * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
