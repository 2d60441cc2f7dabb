"""Llama 3 family configuration: a frozen dataclass, named presets, parameter and FLOP counts.

`models.llama` re-exports everything here; import it from there (`llama.LlamaConfig`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

# Remat policies for the per-layer body (names match jax.checkpoint_policies where one exists):
# "none" saves every activation (fastest, most memory); "full" saves only the layer input and
# recomputes the whole layer in the backward; "dots_saveable" keeps matmul outputs and
# recomputes the cheap elementwise work (norms, RoPE, SwiGLU, softmax);
# "dots_with_no_batch_dims_saveable" keeps only the weight matmuls (not QK^T / PV);
# "megatron" keeps the tensors Megatron-LM keeps (MEGATRON_SAVED, named in models.layers)
# and recomputes every unnamed intermediate (layout copies, casts); "elementwise" keeps all
# but the RMSNorm outputs and the SwiGLU product, recomputed from the norm inputs and gate/up
# that their backward keeps anyway; "mlp" keeps everything but the MLP block's (its norm
# output, its GEMM inputs' copies, gate, up and the SwiGLU product) and rebuilds the block from
# its input, the mid-layer residual, which the layer keeps anyway: two GEMMs more per layer
# (gate and up), no attention forward again. Residuals of a custom VJP (models.activation_vjp, the
# quantized dot_general, cuDNN attention) are kept whatever the policy (docs/models.md).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "megatron",
                  "elementwise", "mlp")
# The policies applied as a jax.checkpoint around each layer's whole body ("mlp" checkpoints
# the MLP block inside the layer: models.layers.Block).
LAYER_BODY_REMATS = tuple(p for p in REMAT_POLICIES if p not in ("none", "mlp"))
# Named activations of a layer (jax.ad_checkpoint.checkpoint_name in models.layers).
MEGATRON_SAVED = ("norm_out", "q", "k", "v", "attn_out", "residual", "gate", "up", "mlp_act")
RECOMPUTED_ELEMENTWISE = ("norm_out", "mlp_act")
# What a block rebuilt in the backward (remat "mlp", recompute_mlp_product) keeps of its
# forward: FP8-CS's tensor amaxes, which lp_jax's quantizer names so (lp_jax.numerics.
# quantize.TENSOR_AMAX), one scalar per quantized tensor, so that the rebuild casts its
# tensors to FP8 again without reducing each one again.
REBUILD_SAVED = ("tensor_amax",)
# "xla": our einsum core, float32 softmax, materializes [B, heads, L, L] scores (the reference;
# any platform). "cudnn": jax.nn.dot_product_attention's cuDNN flash kernel (GPU only).
ATTENTION_IMPLS = ("xla", "cudnn")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF `rope_type: llama3`): long wavelengths are divided
    by `factor`, short ones kept, and the band between is interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for field in dataclasses.fields(self):  # from a config file: one line, not a TypeError
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"rope_scaling {field.name} must be a number, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope_scaling factor and original_max_position_embeddings must be "
                             f"positive, got {self.factor} and {self.original_max_position_embeddings}")

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


def rope_scaling_from_dict(d: Mapping[str, Any] | Llama3RopeScaling | None) -> Llama3RopeScaling | None:
    """Accepts None, a Llama3RopeScaling, or HF's dict (`rope_type` or the older `type` key)."""
    if d is None or isinstance(d, Llama3RopeScaling):
        return d
    d = dict(d)
    kind = d.pop("rope_type", d.pop("type", "llama3"))
    d.pop("rope_theta", None)  # transformers 5.x keeps theta in the same dict
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}; supported: 'default', 'llama3'")
    fields = {f.name for f in dataclasses.fields(Llama3RopeScaling)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"unknown llama3 rope_scaling keys {unknown}; allowed: {sorted(fields)}")
    return Llama3RopeScaling(**d)


def _as_dtype(value, field: str, allowed: tuple[str, ...]):
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"{field}={value!r} is not a dtype; allowed: {', '.join(allowed)}") from None
    if dt.name not in allowed:
        raise ValueError(f"{field}={dt.name} is not supported; allowed: {', '.join(allowed)}")
    return dt


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama 3 style decoder. Frozen and hashable, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads must be a multiple
    head_dim: int
    rope_theta: float = 500_000.0
    rope_scaling: Llama3RopeScaling | None = None  # a dict in HF's form is converted
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 8192  # longest sequence the presets are meant for; not a hard limit
    init_std: float = 0.02  # output projections use init_std / sqrt(2 * num_layers)
    scan_layers: bool = False  # scan over runs of identical layers (compile time at depth)
    remat: str = "none"  # one of REMAT_POLICIES, applied to each layer's body
    attention_impl: str = "xla"  # one of ATTENTION_IMPLS
    # cudnn: document slots per row of cuDNN's packed layout (models.cudnn_attention); a row
    # with more documents lets its last ones see each other.
    max_documents: int = 32
    # The backward rebuilds the SwiGLU product (the down projection's input) and whatever
    # copies of it the down projection's GEMM keeps (a quantized recipe's FP8/FP4 copies)
    # from gate and up, which SwiGLU's backward keeps anyway, instead of saving them: one
    # elementwise pass and quantization more per layer (models.layers.MLP).
    recompute_mlp_product: bool = False
    # One QKV and one gate/up Linear per layer (`attn/qkv`, `mlp/gate_up`) in Megatron's
    # layout instead of five (models.fused_projections): one GEMM, and in a quantized recipe
    # one set of scales, each. The weights convert exactly between the two layouts.
    fused_projections: bool = False
    # Qwen3's QK-norm: an RMSNorm over head_dim (scale [head_dim], shared by the heads) on
    # each query and key head, after the projections and before RoPE (models.layers.Attention).
    qk_norm: bool = False
    # Mixture of experts (model.type=moe, models.moe; Megatron's names where it has them):
    # the experts per layer (0: the dense MLP), how many each token reaches, each expert's
    # SwiGLU width (0: intermediate_size), whether the top-k probabilities are renormalized
    # (Qwen3's norm_topk_prob), the load-balancing and router z-loss coefficients.
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 1e-3
    moe_z_loss_coeff: float = 0.0
    dtype: Any = jnp.bfloat16  # compute dtype: activations, matmul inputs, logits
    param_dtype: Any = jnp.float32  # master weights

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len", "max_documents"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; allowed: {', '.join(REMAT_POLICIES)}")
        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("recompute_mlp_product", "fused_projections", "qk_norm", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}; allowed: {', '.join(ATTENTION_IMPLS)}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0 or not self.init_std > 0:
            raise ValueError(f"rope_theta, rms_norm_eps and init_std must be positive, got "
                             f"{self.rope_theta}, {self.rms_norm_eps}, {self.init_std}")
        set_("rope_scaling", rope_scaling_from_dict(self.rope_scaling))
        set_("dtype", _as_dtype(self.dtype, "dtype", COMPUTE_DTYPES))
        set_("param_dtype", _as_dtype(self.param_dtype, "param_dtype", COMPUTE_DTYPES))

    def replace(self, **overrides) -> "LlamaConfig":
        return dataclasses.replace(self, **overrides)


_LLAMA3_ROPE = dict(rope_theta=500_000.0, rms_norm_eps=1e-5)

PRESETS: dict[str, dict[str, Any]] = {
    # Byte-level vocabulary (256 bytes + specials, rounded up to a multiple of 128); trains on
    # 2 CPU cores in minutes. GQA 2:1 so the CPU tests exercise grouped attention.
    "tiny": dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0,
                 max_seq_len=256),
    # 131M in all with the Llama 3 vocabulary (74M of it the tied embedding, 57M in 16
    # layers); SmolLM-135M's width (576, 9 heads, 3 KV heads, FFN 1536), 16 layers deep.
    "llama3_125m": dict(vocab_size=128_256, hidden_size=576, intermediate_size=1536,
                        num_layers=16, num_heads=9, num_kv_heads=3, head_dim=64,
                        tie_embeddings=True, max_seq_len=2048, **_LLAMA3_ROPE),
    # Llama 3.2 1B exactly (so its HF checkpoint imports), trained at 8192.
    "llama3_1b": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192,
                      num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      tie_embeddings=True, max_seq_len=8192,
                      rope_scaling=Llama3RopeScaling(factor=32.0), **_LLAMA3_ROPE),
    # The Llama 3 8B of Megatron Bridge's pretraining recipe (docs/numerics.md).
    "llama3_8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      max_seq_len=8192, **_LLAMA3_ROPE),
    # A deeper, narrower 8B for low-precision research (docs/models.md says why): 48 layers
    # of width 3584, GQA 7:1, every GEMM dimension a multiple of 128, same tokenizer.
    "research_8b": dict(vocab_size=128_256, hidden_size=3584, intermediate_size=11_264,
                        num_layers=48, num_heads=28, num_kv_heads=4, head_dim=128,
                        max_seq_len=8192, **_LLAMA3_ROPE),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A named configuration, with any field overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig fields {unknown}; valid: {', '.join(sorted(fields))}")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def count_params(cfg: LlamaConfig, *, embedding: bool = True) -> int:
    """Number of parameters; `embedding=False` leaves out the input embedding table (the LM
    head stays: it is a matmul)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size + 2 * d
    per_layer += 2 * cfg.head_dim if cfg.qk_norm else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    embed = cfg.vocab_size * d
    total = cfg.num_layers * per_layer + d + head + embed
    if not embedding:
        total -= embed
    return total


# LlamaConfig fields that fix the parameters (their shapes, tying, the QK-norm scales and
# the experts): a checkpoint or a set of weights decides them; the others (remat, scan,
# attention kernel, dtypes, RoPE base, ...) may differ between runs that share weights.
# fused_projections is not among them: weights of either layout convert exactly to the
# other (models.fused_projections).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_embeddings", "qk_norm", "num_experts",
                "moe_ffn_hidden_size")
# The fields that make a model compute what it computes (its shapes, RoPE, norm, context
# length, layer layout and routing): what a reader of saved weights rebuilds. Remat, the
# attention kernel and the dtypes are choices of the program that runs it.
ARCHITECTURE_FIELDS = SHAPE_FIELDS + ("rope_theta", "rope_scaling", "rms_norm_eps", "max_seq_len",
                                      "scan_layers", "fused_projections", "moe_router_topk",
                                      "norm_topk_prob")


def architecture(cfg: LlamaConfig, **choices) -> LlamaConfig:
    """A LlamaConfig with ``cfg``'s ARCHITECTURE_FIELDS and the defaults (or ``choices``)
    for the rest."""
    return LlamaConfig(**{k: getattr(cfg, k) for k in ARCHITECTURE_FIELDS}, **choices)


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights that take part in a matmul per token: every projection plus the LM head (which
    multiplies even when tied); the embedding lookup and the norm scales do not."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * d


def flops_per_token(cfg: LlamaConfig, seq_len: int, *, causal: bool = False,
                    training: bool = True) -> float:
    """Model FLOPs per token: 6N + 12 * layers * heads * head_dim * seq_len for training
    (PaLM appendix B and Megatron-LM's formula), with N = matmul_params(cfg); the attention
    term counts QK^T and PV (2 matmuls x 2 FLOPs per multiply-add x 3 for forward+backward).
    `causal=True` halves the attention term (what a kernel that skips masked blocks does);
    the default counts the full square, as PaLM and Megatron report MFU. `training=False`
    gives the forward only (2N + 4 * layers * heads * head_dim * seq_len)."""
    passes = 3 if training else 1
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    if causal:
        attention /= 2
    return passes * (2 * matmul_params(cfg) + attention)


def output_init_std(cfg: LlamaConfig) -> float:
    """Init std of o_proj and down_proj: scaled so the residual stream's variance does not grow
    with depth (GPT-2 / Megatron's 'scaled init' for output layers)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def config_to_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """JSON-ready fields (dtypes by name, RoPE scaling as HF's dict); inverse of config_from_dict."""
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf()
    d["dtype"], d["param_dtype"] = cfg.dtype.name, cfg.param_dtype.name
    return d


def config_from_dict(d: Mapping[str, Any]) -> LlamaConfig:
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig fields {unknown}; valid: {', '.join(sorted(fields))}")
    return LlamaConfig(**d)
