"""Hugging Face `config.json` <-> LlamaConfig, and the HF tensor names of each parameter.

Two architectures: `LlamaForCausalLM` (model_type `llama`, lp_jax's Llama) and
`Qwen3MoeForCausalLM` (model_type `qwen3_moe`, lp_jax's MoE family, models.moe: QK-norm,
a router and experts in every layer). A LlamaConfig with `num_experts` > 0 is the latter.

transformers 4.x writes RoPE as `rope_theta` + `rope_scaling` (null or a dict); 5.x writes one
`rope_parameters` dict (`rope_type`, `rope_theta`, and the scaling keys). Both are read; both
are written, so that either major version loads an exported folder.
"""
from __future__ import annotations

from typing import Any, Iterator

from models.config import Llama3RopeScaling, LlamaConfig, rope_scaling_from_dict
from models.hf_experts import expert_tensors

# model_type -> architecture; a folder's config.json names both.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())


class HFError(ValueError):
    """Bad Hugging Face input: a missing file, a shape or dtype that does not fit, an
    unsupported architecture or RoPE type. The message is one line."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise HFError(message)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from either style; `original_max_position_embeddings` defaults to
    `max_position_embeddings`, as transformers does."""
    params = d.get("rope_parameters")
    for key in ("rope_parameters", "rope_scaling"):
        _require(d.get(key) is None or isinstance(d[key], dict),
                 f"bad RoPE settings in config.json: {key} is not an object")
    if params is not None:
        params = dict(params)
        theta = params.get("rope_theta", d.get("rope_theta", 10_000.0))
        scaling = params
    else:
        theta = d.get("rope_theta", 10_000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {"rope_type": "default"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"unsupported rope_type {kind!r} in config.json; supported: 'default', 'llama3'")
    prf = scaling.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    _require(prf == 1.0, f"unsupported partial_rotary_factor {prf} in config.json; supported: 1.0")
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
        keep = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        scaling = {k: v for k, v in scaling.items() if k in keep}
    try:
        return float(theta), rope_scaling_from_dict(scaling)
    except (TypeError, ValueError) as e:
        raise HFError(f"bad RoPE settings in config.json: {e}") from None


def config_from_hf(d: dict[str, Any], *, dtype, param_dtype) -> LlamaConfig:
    archs = d.get("architectures") or []
    _require(not archs or any(a in SUPPORTED_ARCHITECTURES for a in archs),
             f"unsupported architecture {archs} in config.json; "
             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = d.get("model_type", "llama")
    _require(model_type in ARCHITECTURES,
             f"unsupported model_type {model_type!r} in config.json; supported: "
             f"{', '.join(map(repr, ARCHITECTURES))}")
    _require(not archs or ARCHITECTURES[model_type] in archs,
             f"config.json's architectures {archs} do not match its model_type {model_type!r}")
    act = d.get("hidden_act", "silu")
    _require(act == "silu", f"unsupported hidden_act {act!r} in config.json; supported: 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        _require(not d.get(flag, False),
                 f"unsupported {flag}=true in config.json; lp_jax's models have no biases")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    _require(not missing, f"config.json lacks {missing}")
    theta, scaling = _rope_from_hf(d)
    heads = d["num_attention_heads"]
    moe = _moe_fields(d) if model_type == "qwen3_moe" else {}
    try:
        return LlamaConfig(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_seq_len=int(d.get("max_position_embeddings", 8192)),
            init_std=float(d.get("initializer_range", 0.02)), dtype=dtype, param_dtype=param_dtype,
            **moe)
    except (TypeError, ValueError) as e:  # a value of the wrong type: a list for a number
        raise HFError(f"config.json does not describe a valid {ARCHITECTURES[model_type]}: {e}") from None


def _moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig fields of a qwen3_moe config.json (transformers' Qwen3MoeConfig, whose
    defaults fill the keys it lacks); one line for what lp_jax's MoE does not model."""
    _require(not d.get("use_sliding_window", False),
             "unsupported use_sliding_window=true in config.json; lp_jax attends to the whole context")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        _require(not d.get(key), f"unsupported {key}={d.get(key)!r} in config.json; "
                 "lp_jax's MoE has no shared experts")
    experts, topk = d.get("num_experts", 128), d.get("num_experts_per_tok", 8)
    _require(isinstance(experts, int) and experts >= 2,
             f"config.json has num_experts={experts!r}; lp_jax's MoE needs at least 2")
    _require(isinstance(topk, int) and 1 <= topk <= experts,
             f"config.json has num_experts_per_tok={topk!r}; it must be between 1 and num_experts={experts}")
    # transformers makes layer i sparse iff i is not in mlp_only_layers and (i + 1) is a
    # multiple of decoder_sparse_step; lp_jax's MoE has sparse layers only.
    step, dense = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers") or []
    _require(isinstance(dense, list), f"config.json's mlp_only_layers {dense!r} is not a list")
    layers = d["num_hidden_layers"] if isinstance(d["num_hidden_layers"], int) else 0  # else refused below
    dense_layers = sorted({i for i in range(layers)
                           if i in dense or not isinstance(step, int) or step < 1 or (i + 1) % step})
    _require(not dense_layers, f"config.json makes layers {dense_layers} dense "
             f"(decoder_sparse_step={step!r}, mlp_only_layers={dense}); lp_jax's MoE has experts "
             "in every layer: decoder_sparse_step 1 and no mlp_only_layers")
    return dict(qk_norm=True, num_experts=experts,
                moe_router_topk=topk,
                moe_ffn_hidden_size=d.get("moe_intermediate_size", 768),
                norm_topk_prob=d.get("norm_topk_prob", False),
                moe_aux_loss_coeff=d.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: LlamaConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json of the folder: LlamaForCausalLM's, or Qwen3MoeForCausalLM's when
    cfg.num_experts > 0 (the keys transformers' LlamaConfig / Qwen3MoeConfig writes)."""
    scaling = None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf()
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling is not None:
        rope_parameters.update(scaling)
    moe = cfg.num_experts > 0
    model_type = "qwen3_moe" if moe else "llama"
    # Neither architecture has a switch for QK-norm: Qwen3-MoE always norms q and k (a scale
    # of ones still normalizes them), Llama never does.
    _require(cfg.qk_norm == moe, f"a model with {'no ' if moe else ''}QK-norm"
             f"{' and experts' if moe else ' and no experts'} has no Hugging Face architecture "
             f"here: {ARCHITECTURES[model_type]} {'norms' if moe else 'does not norm'} q and k "
             f"(model.qk_norm={str(moe).lower()})")
    common = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_scaling": scaling,  # transformers 4.x
        "rope_parameters": rope_parameters,  # transformers 5.x
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": torch_dtype,  # transformers 4.x
        "dtype": torch_dtype,  # transformers 5.x
    }
    if not moe:
        return {**common, "mlp_bias": False}
    return {
        **common,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False,
    }


# HF name template -> (our parameter path template, transpose?). nnx.Linear kernels are
# [in, out]; torch Linear weights are [out, in].
_ATTENTION_TENSORS = (
    ("input_layernorm.weight", ("attn_norm", "scale"), False),
    ("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), True),
    ("self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), True),
    ("self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), True),
    ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), True),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), False),
)
_QK_NORM_TENSORS = (
    ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), False),
    ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), False),
)
_MLP_TENSORS = (
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
)
# The router's [D, E] kernel is the transpose of transformers' gate Linear [E, D].
_ROUTER_TENSOR = ("mlp.gate.weight", ("mlp", "router", "kernel"), True)


def tensor_map(cfg: LlamaConfig) -> Iterator[tuple[str, tuple, bool]]:
    """(HF tensor name, our parameter path, transpose) for every parameter of the model in
    the separate layout (models.fused_projections joins q/k/v and gate/up from it). An
    expert's three weights map to the paths of models.hf_experts (`mlp/experts/<e>/...`),
    slices of the MoE's grouped kernels that models.hf_experts joins and splits."""
    yield "model.embed_tokens.weight", ("embed", "embedding"), False
    for i in range(cfg.num_layers):
        layer = _ATTENTION_TENSORS + (_QK_NORM_TENSORS if cfg.qk_norm else ())
        if cfg.num_experts:
            layer += (_ROUTER_TENSOR, *expert_tensors(cfg.num_experts))
        else:
            layer += _MLP_TENSORS
        for hf_name, path, transpose in layer:
            yield f"model.layers.{i}.{hf_name}", ("layers", i, *path), transpose
    yield "model.norm.weight", ("final_norm", "scale"), False
    if not cfg.tie_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


# Tensors some checkpoints carry that are not weights of the model.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
