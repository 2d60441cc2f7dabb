"""A Qwen3-MoE-style mixture-of-experts decoder: Llama's attention, and in every layer a
routed MLP of ``num_experts`` SwiGLU experts in place of the dense one.

Routing, as Qwen3-MoE and Megatron's defaults do it: the router is an FP32 GEMM, never
quantized (``lp_never_quantized``); softmax over the experts, the top ``moe_router_topk``,
their probabilities renormalized to sum to 1 when ``norm_topk_prob``; dropless (every
token reaches its k experts; the grouped GEMM takes any group sizes). The experts' GEMMs
are two ``GroupedLinear``s (gate/up fused, down) over the routed rows sorted by expert,
which ``apply_recipe`` swaps for ``lp_jax.ragged_dot`` like any Linear. Under a mesh
whose ``expert`` axis splits (``mesh.expert``), the routed rows travel to the ranks that hold
their experts and back (``models.moe_dispatch``); the routing stays here, whole-batch.

Losses (Megatron's names): the Switch load-balancing loss ``moe_aux_loss_coeff * E *
sum_e f_e P_e`` (f_e: the share of routed rows that went to expert e, P_e: its mean router
probability) and the router z-loss ``moe_z_loss_coeff * mean(logsumexp(logits)^2)``, per
layer, summed over layers; over the whole batch where ranks split it (as on one device).
The model returns ``(logits, extras)``: ``extras["aux_loss"]`` is added to the objective
per token (``lp_jax.training.step``), and ``moe_load_max`` /
``moe_load_min`` (an expert's routed rows over an even share, the extremes over experts
and layers: 1.0 is perfect balance) are reported with the loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models import moe_dispatch
from models.activation_vjp import swiglu
from models.config import LlamaConfig, output_init_std
from models.config import preset as config_preset
from models.layers import Attention, Block, RMSNorm
from models.llama import Llama


class Router(nnx.Module):
    """The expert scores of each token, an FP32 GEMM that no recipe quantizes."""

    lp_never_quantized = True

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.kernel = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.num_experts), jnp.float32))

    def __call__(self, x_TxD):
        return jnp.dot(x_TxD.astype(jnp.float32), self.kernel[...], precision=lax.Precision.HIGHEST)


class GroupedLinear(nnx.Module):
    """One GEMM per expert over its rows: ``ragged_dot(x [M, K], kernel [E, K, N], sizes [E])``.
    ``ragged_dot`` is ``jax.lax.ragged_dot`` (BF16) until ``apply_recipe`` sets lp_jax's."""

    def __init__(self, experts: int, d_in: int, d_out: int, std: float, cfg: LlamaConfig, *,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.kernel = nnx.Param(init(rngs.params(), (experts, d_in, d_out), cfg.param_dtype))
        self.dtype = cfg.dtype
        self.ragged_dot = lax.ragged_dot

    def __call__(self, x_MxK, group_sizes, kernel=None, first_group=0, expected_rows=None):
        """``kernel``: this expert rank's slice of the kernel (expert parallelism,
        models.moe_dispatch), whose first expert is expert ``first_group``; None: all of it.
        ``expected_rows``: the rows of ``x_MxK`` even routing fills (it is a worst-case
        buffer there); None: all of them."""
        kernel = self.kernel[...] if kernel is None else kernel
        if not getattr(self.ragged_dot, "keeps_kernel_dtype", False):
            kernel = kernel.astype(self.dtype)
        # lp_jax's grouped GEMM keys each expert's stochastic rounding by its global index.
        offset = ({"first_group": first_group, "expected_rows": expected_rows}
                  if getattr(self.ragged_dot, "takes_first_group", False) else {})
        return self.ragged_dot(x_MxK.astype(self.dtype), kernel, group_sizes,
                               preferred_element_type=self.dtype, **offset)


def route(logits_TxE, k: int, norm_topk_prob: bool):
    """(weights [T, k] FP32, experts [T, k] int32, probabilities [T, E]) of each token."""
    probs = jax.nn.softmax(logits_TxE, axis=-1)
    weights, experts = lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


class MoE(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        e, d = cfg.num_experts, cfg.hidden_size
        f = cfg.moe_ffn_hidden_size or cfg.intermediate_size
        self.config = cfg
        self.router = Router(cfg, rngs=rngs)
        self.gate_up = GroupedLinear(e, d, 2 * f, cfg.init_std, cfg, rngs=rngs)
        self.down = GroupedLinear(e, f, d, output_init_std(cfg), cfg, rngs=rngs)
        # How the expert-parallel dispatch encodes the rows it sends (models.moe_dispatch):
        # None sends them in the activation dtype; the trainer sets lp_jax's FP8 dispatch
        # here (mesh.ep_dispatch_dtype=fp8). A static attribute: no state, no checkpoint.
        self.dispatch_codec = None

    def __call__(self, x_BxLxD):
        """(output [B, L, D], this layer's {aux_loss, z_loss, load [E]})."""
        cfg = self.config
        b, length, d = x_BxLxD.shape
        x = x_BxLxD.reshape(-1, d)
        tokens, k, e = x.shape[0], cfg.moe_router_topk, cfg.num_experts
        logits = self.router(x)
        weights, experts, probs = route(logits, k, cfg.norm_topk_prob)
        flat = experts.reshape(-1)
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        axis = moe_dispatch.expert_axis()
        if axis is None:
            order, token_of_row = moe_dispatch.sorted_by_expert(experts)
            rows = self._experts(x[token_of_row], sizes)
            combined = moe_dispatch.combine(rows, order, token_of_row, weights, tokens)
        else:
            kernels = (self.gate_up.kernel[...], self.down.kernel[...])
            # The rows travel in the dtype the expert GEMMs take them in (they cast to it), so
            # an encoded dispatch quantizes the values those GEMMs would see.
            combined = moe_dispatch.expert_parallel(self._experts, x.astype(cfg.dtype), weights, experts,
                                                    kernels, e, axis, self.dispatch_codec)
        # Switch load balancing: f_e (share of the routed rows) times P_e (mean probability),
        # over the whole batch where ranks split it (moe_dispatch.batch_sum).
        all_tokens = moe_dispatch.batch_sum(jnp.float32(tokens))
        share = moe_dispatch.batch_sum(sizes.astype(jnp.float32)) / (all_tokens * k)
        mean_probs = moe_dispatch.batch_sum(jnp.sum(probs, axis=0)) / all_tokens
        aux = cfg.moe_aux_loss_coeff * e * jnp.sum(share * mean_probs)
        squares = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        z = cfg.moe_z_loss_coeff * moe_dispatch.batch_sum(squares) / all_tokens
        stats = {"aux_loss": aux, "z_loss": z, "load": share * e}
        return combined.astype(x_BxLxD.dtype).reshape(b, length, d), stats

    def _experts(self, rows_MxD, sizes, kernels=(None, None), first_group=0, expected_rows=None):
        """The SwiGLU experts on rows sorted by expert (``sizes`` rows each); ``kernels``:
        an expert rank's slices of (gate_up, down), whose first expert is ``first_group``;
        ``expected_rows``: the rows even routing fills (GroupedLinear)."""
        gate_up, down = kernels
        gate, up = jnp.split(self.gate_up(rows_MxD, sizes, gate_up, first_group, expected_rows), 2, axis=-1)
        return self.down(swiglu(gate, up), sizes, down, first_group, expected_rows)


class MoEBlock(Block):
    """Block with the routed MLP: returns (x, stats)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MoE(cfg, rngs=rngs)
        self.rebuild_mlp = False

    def __call__(self, x_BxLxD, rope, mask_BxTxS, segment_ids_BxL=None, cache=None, cache_index=None):
        if cache is not None:
            raise ValueError("the MoE family has no KV-cache decoding yet")
        h = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), rope, mask_BxTxS, segment_ids_BxL)
        out, stats = self.mlp(self.mlp_norm(h))
        return h + out, stats


class Qwen3MoE(Llama):
    """Llama's embedding, attention, norms and head, with MoEBlock layers. With
    ``scan_layers`` each run of equal layers is one ``lax.scan`` (as for Llama) whose
    per-layer routing statistics come out stacked."""

    block = MoEBlock
    # The scalars the model returns beside its logits and aux_loss, which the train step
    # reports (lp_jax.training.step.forward_objective).
    extra_metrics = ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min")

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        check(cfg)
        super().__init__(cfg, rngs=rngs)

    def _run_layers(self, x, rope, mask, segment_ids, layer_stacks):
        # Always through _layer_runs: MoEBlock returns (x, stats) whatever the remat policy.
        x, stats = self._layer_runs(x, rope, mask, segment_ids, layer_stacks, lambda out: out)
        per_layer = {name: jnp.concatenate([s[name] for s in stats]) for name in stats[0]}
        aux, z = jnp.sum(per_layer["aux_loss"]), jnp.sum(per_layer["z_loss"])
        extras = {"aux_loss": aux + z, "moe_aux_loss": aux, "moe_z_loss": z,
                  "moe_load_max": jnp.max(per_layer["load"]), "moe_load_min": jnp.min(per_layer["load"])}
        return x, extras


PRESETS = {
    # The tiny Llama's attention with 8 experts of width 96, 2 per token: 192 active SwiGLU
    # units per token against the dense tiny's 384. Trains on 2 CPU cores in minutes.
    "tiny": dict(preset="tiny", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96),
    # Qwen3-30B-A3B (its config.json): 48 layers of 128 experts, 8 per token, QK-norm; its
    # Hugging Face checkpoints load into it (models.hf).
    "qwen3_30b_a3b": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                          num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0,
                          rms_norm_eps=1e-6, max_seq_len=40_960, num_experts=128, moe_router_topk=8,
                          moe_ffn_hidden_size=768, norm_topk_prob=True, moe_aux_loss_coeff=1e-3,
                          qk_norm=True),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """The MoE family's ``model.preset``: tiny or qwen3_30b_a3b, with ``model.*`` overrides;
    ValueError (one line) for a shape the family cannot build."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} for model.type=moe; available: {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    base = fields.pop("preset", None)
    cfg = (config_preset(base, **{**fields, **overrides}) if base is not None
           else LlamaConfig(**{**fields, **overrides}))
    check(cfg)
    return cfg


def check(cfg: LlamaConfig) -> None:
    """One line for an architecture the MoE family cannot build."""
    if cfg.num_experts < 2:
        raise ValueError(f"model.type=moe needs model.num_experts >= 2, got {cfg.num_experts}")
    if not 1 <= cfg.moe_router_topk <= cfg.num_experts:
        raise ValueError(f"model.moe_router_topk={cfg.moe_router_topk} must be between 1 and "
                         f"model.num_experts={cfg.num_experts}")
    if cfg.remat == "mlp":
        raise ValueError("model.remat=mlp rebuilds a dense MLP block; model.type=moe takes none, full, "
                         "dots_saveable, dots_with_no_batch_dims_saveable, megatron or elementwise")


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token of the active parameters: 6 x (attention and the k routed
    experts' GEMMs, the router, the head) plus attention's 12 L H d_head T."""
    f = cfg.moe_ffn_hidden_size or cfg.intermediate_size
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * (q + 2 * kv) + q * d + cfg.moe_router_topk * 3 * d * f + d * cfg.num_experts
    active = cfg.num_layers * per_layer + cfg.vocab_size * d
    return 6.0 * active + 12.0 * cfg.num_layers * q * seq_len
