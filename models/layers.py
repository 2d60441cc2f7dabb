"""The pieces of a Llama 3 block: RMSNorm, RoPE (with Llama 3 scaling), GQA attention, SwiGLU.

Shape suffixes: B batch, T query length, S key length, D hidden, N query heads, K KV heads,
G = N / K heads per KV group, H head_dim, F intermediate, V vocabulary.
Every projection is a plain `nnx.Linear` with the default dot_general, so `lp_jax.apply_recipe`
can swap its `dot_general` in place; nothing here knows about precision recipes. With
`fused_projections`, q/k/v are one Linear and gate/up another (models.fused_projections).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.activation_vjp import rms_norm, rope, swiglu
from models.config import REBUILD_SAVED, LlamaConfig, output_init_std
from models.cudnn_attention import cudnn_attention
from models.fused_projections import split_gate_up, split_qkv
from models.sharding import constrain

# Logical activation axes (``models.sharding``): no-ops unless a trainer maps them to a mesh.
BLD = ("batch", "sequence", "embed")

# Additive mask value: finite, so a row with nothing to attend to (a padding query in a KV
# cache) gives a uniform softmax instead of NaN.
_MASKED = float(np.finfo(np.float32).min)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 whatever the compute dtype (as HF and Megatron);
    the backward keeps x and scale only (models.activation_vjp)."""

    def __init__(self, features: int, cfg: LlamaConfig):
        self.eps = cfg.rms_norm_eps
        self.dtype = cfg.dtype
        self.scale = nnx.Param(jnp.ones((features,), cfg.param_dtype))

    def __call__(self, x_BxLxD):
        return checkpoint_name(rms_norm(x_BxLxD, self.scale[...], self.eps, self.dtype), "norm_out")


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Per-pair inverse frequencies [H/2], float32, computed as transformers does (float32 powers
    of theta, then Llama 3 scaling) so imported checkpoints match to rounding."""
    exponent = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(cfg.head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: wavelengths beyond original/low_freq_factor are stretched by `factor`, those
    # below original/high_freq_factor are kept, and the band between is interpolated.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    smooth = ((np.float32(s.original_max_position_embeddings) / wavelen - np.float32(s.low_freq_factor))
              / np.float32(s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions_BxL, cfg: LlamaConfig):
    """(cos, sin), each float32 [B, L, H/2], for the given integer positions."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    angles_BxLxH2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles_BxLxH2), jnp.sin(angles_BxLxH2)


def apply_rope(x_BxLxNxH, cos_BxLxH2, sin_BxLxH2):
    """Rotates the pairs (i, i + H/2) ("rotate_half", HF's layout), in float32."""
    return rope(x_BxLxNxH, cos_BxLxH2, sin_BxLxH2)


def attention_core(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
    """softmax(q k^T / sqrt(H) + mask) v with grouped KV heads (never repeated in memory).

    Scores and softmax in float32; the probabilities are cast back to the compute dtype for the
    PV matmul (as transformers does). Memory: the float32 scores are B*N*T*S*4 bytes; at long
    sequences use remat (the scores are not saved by "full" or
    "dots_with_no_batch_dims_saveable") or attention_impl="cudnn" (docs/models.md).
    """
    b, t, n, h = q_BxTxNxH.shape
    k = k_BxSxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                        preferred_element_type=jnp.float32) * (1.0 / math.sqrt(h))
    scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
    return out_BxTxKxGxH.reshape(b, t, n, h)


def attention_dpa(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxL, implementation):
    """The same attention through jax.nn.dot_product_attention (causal, plus the document mask
    as a dense [B, 1, T, S] mask when segment_ids is given): a second reference for the
    layout and GQA on CPU (implementation="xla"). Training on a GPU uses
    ``models.cudnn_attention``, which takes the documents as cuDNN's packed layout."""
    mask = None
    if segment_ids_BxL is not None:
        mask = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask,
                                        is_causal=True, implementation=implementation)


def _linear(cfg: LlamaConfig, rngs: nnx.Rngs, d_in: int, d_out: int, std: float) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.fused_projections:
            self.qkv = _linear(cfg, rngs, d, q + 2 * kv, cfg.init_std)
        else:
            self.q_proj = _linear(cfg, rngs, d, q, cfg.init_std)
            self.k_proj = _linear(cfg, rngs, d, kv, cfg.init_std)
            self.v_proj = _linear(cfg, rngs, d, kv, cfg.init_std)
        self.o_proj = _linear(cfg, rngs, q, d, output_init_std(cfg))
        if cfg.qk_norm:  # Qwen3: one scale per head_dim entry, shared by all heads
            self.q_norm = RMSNorm(cfg.head_dim, cfg)
            self.k_norm = RMSNorm(cfg.head_dim, cfg)

    def __call__(self, x_BxTxD, rope, mask_BxTxS, segment_ids_BxL=None, cache=None, cache_index=None):
        """Returns the output [B, T, D]; with a KV cache ((k, v), each [B, S, K, H]), returns
        (output, updated cache), the new keys written at `cache_index`."""
        cfg = self.config
        b, t, _ = x_BxTxD.shape
        q, k, v = self._project(x_BxTxD)
        # Names for the remat policies (models.config.MEGATRON_SAVED).
        q = checkpoint_name(q, "q").reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = checkpoint_name(k, "k").reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = checkpoint_name(v, "v").reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        # Tensor parallelism splits whole heads: each rank attends with its own heads.
        q = constrain(q, ("batch", "sequence", "heads", "head_dim"))
        k = constrain(k, ("batch", "sequence", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "sequence", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
            out = attention_core(q, k, v, mask_BxTxS)
        elif cfg.attention_impl == "cudnn":
            out = cudnn_attention(q, k, v, segment_ids_BxL, cfg.max_documents)
        else:
            out = attention_core(q, k, v, mask_BxTxS)
        out = checkpoint_name(out.reshape(b, t, cfg.num_heads * cfg.head_dim), "attn_out")
        out = constrain(self.o_proj(out), BLD)
        return out if cache is None else (out, (k, v))

    def _project(self, x_BxTxD):
        """(q [B, T, N*H], k [B, T, K*H], v [B, T, K*H]): one GEMM or three."""
        cfg = self.config
        if cfg.fused_projections:
            return split_qkv(self.qkv(x_BxTxD), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return self.q_proj(x_BxTxD), self.k_proj(x_BxTxD), self.v_proj(x_BxTxD)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the gating is computed in float32, and its backward
    keeps gate and up in the compute dtype (models.activation_vjp).

    With ``recompute_mlp_product`` the product and the down projection run under a remat
    that saves nothing: the backward rebuilds the product, and what the down projection's
    GEMM keeps of it (the BF16 product, or a quantized recipe's FP8/FP4 copies), from gate
    and up, which SwiGLU's backward holds already. The forward GEMM is not run again (its
    output is not needed there)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.fused = cfg.fused_projections
        if self.fused:
            self.gate_up = _linear(cfg, rngs, d, 2 * f, cfg.init_std)
        else:
            self.gate_proj = _linear(cfg, rngs, d, f, cfg.init_std)
            self.up_proj = _linear(cfg, rngs, d, f, cfg.init_std)
        self.down_proj = _linear(cfg, rngs, f, d, output_init_std(cfg))
        self.recompute_product = cfg.recompute_mlp_product

    def __call__(self, x_BxLxD):
        if self.fused:
            gate, up = split_gate_up(self.gate_up(x_BxLxD))
        else:
            gate, up = self.gate_proj(x_BxLxD), self.up_proj(x_BxLxD)
        gate, up = checkpoint_name(gate, "gate"), checkpoint_name(up, "up")
        down = _rebuilt_in_backward(_down_of_product) if self.recompute_product else _down_of_product
        return constrain(down((self.down_proj,), gate, up), BLD)


def _down_of_product(modules, gate, up):
    (down_proj,) = modules
    h_BxLxF = checkpoint_name(swiglu(gate, up), "mlp_act")
    return down_proj(constrain(h_BxLxF, ("batch", "sequence", "mlp")))


def _mlp_of_residual(modules, h_BxLxD):
    norm, mlp = modules
    return mlp(norm(h_BxLxD))


# The remat policy of a block rebuilt in the backward: nothing of what it computes is saved
# but FP8-CS's scalar amaxes (REBUILD_SAVED).
REBUILD_POLICY = jax.checkpoint_policies.save_only_these_names(*REBUILD_SAVED)


def _rebuilt_in_backward(fn):
    """``fn(modules, *arrays)`` (a tuple of modules) under REBUILD_POLICY: the backward runs it
    again from its inputs. The modules enter as their state and are merged afresh inside, so that
    nothing is written back to Variables of another trace (nnx.remat would, and the
    trainer's steps merge the model inside a scan)."""
    def run(modules, *arrays):
        splits = [nnx.split(m) for m in modules]

        def pure(states, *arrays):
            return fn(tuple(nnx.merge(g, s) for (g, _), s in zip(splits, states)), *arrays)

        states = tuple(s for _, s in splits)
        return jax.checkpoint(pure, policy=REBUILD_POLICY)(states, *arrays)
    return run


class Block(nnx.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then h + mlp(norm(h)).

    With ``remat="mlp"`` the MLP block (its norm, the three projections and SwiGLU) runs
    under a remat that saves nothing: the backward rebuilds it from h, which the layer keeps
    anyway, so none of its activations (the norm output, the GEMM inputs' copies, gate, up,
    the product) is kept. The rebuild runs the norm, gate and up again, not attention."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg, rngs=rngs)
        self.rebuild_mlp = cfg.remat == "mlp"

    def __call__(self, x_BxLxD, rope, mask_BxTxS, segment_ids_BxL=None, cache=None, cache_index=None):
        attn = self.attn(self.attn_norm(x_BxLxD), rope, mask_BxTxS, segment_ids_BxL, cache, cache_index)
        if cache is not None:
            attn, cache = attn
        h_BxLxD = checkpoint_name(x_BxLxD + attn, "residual")
        mlp = _rebuilt_in_backward(_mlp_of_residual) if self.rebuild_mlp and cache is None else _mlp_of_residual
        out = h_BxLxD + mlp((self.mlp_norm, self.mlp), h_BxLxD)
        return out if cache is None else (out, cache)

