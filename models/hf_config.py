"""Hugging Face `config.json` <-> LlamaConfig, and the HF tensor names of each parameter.

transformers 4.x writes RoPE as `rope_theta` + `rope_scaling` (null or a dict); 5.x writes one
`rope_parameters` dict (`rope_type`, `rope_theta`, and the scaling keys). Both are read; both
are written, so that either major version loads an exported folder.
"""
from __future__ import annotations

from typing import Any, Iterator

from models.config import Llama3RopeScaling, LlamaConfig, rope_scaling_from_dict

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


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
    _require(model_type == "llama",
             f"unsupported model_type {model_type!r} in config.json; supported: 'llama'")
    act = d.get("hidden_act", "silu")
    _require(act == "silu", f"unsupported hidden_act {act!r} in config.json; supported: 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        _require(not d.get(flag, False), f"unsupported {flag}=true in config.json; this Llama has no biases")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    _require(not missing, f"config.json lacks {missing}")
    theta, scaling = _rope_from_hf(d)
    heads = d["num_attention_heads"]
    try:
        return LlamaConfig(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_seq_len=int(d.get("max_position_embeddings", 8192)),
            init_std=float(d.get("initializer_range", 0.02)), dtype=dtype, param_dtype=param_dtype)
    except (TypeError, ValueError) as e:  # a value of the wrong type: a list for a number
        raise HFError(f"config.json does not describe a valid Llama: {e}") from None


def config_to_hf(cfg: LlamaConfig, torch_dtype: str) -> dict[str, Any]:
    scaling = None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf()
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling is not None:
        rope_parameters.update(scaling)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": torch_dtype,  # transformers 4.x
        "dtype": torch_dtype,  # transformers 5.x
    }


# HF name template -> (our parameter path template, transpose?). nnx.Linear kernels are
# [in, out]; torch Linear weights are [out, in].
_LAYER_TENSORS = (
    ("input_layernorm.weight", ("attn_norm", "scale"), False),
    ("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), True),
    ("self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), True),
    ("self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), True),
    ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), True),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), False),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
)


def tensor_map(cfg: LlamaConfig) -> Iterator[tuple[str, tuple, bool]]:
    """(HF tensor name, our parameter path, transpose) for every parameter of the model in
    the separate layout (models.fused_projections joins q/k/v and gate/up from it)."""
    yield "model.embed_tokens.weight", ("embed", "embedding"), False
    for i in range(cfg.num_layers):
        for hf_name, path, transpose in _LAYER_TENSORS:
            yield f"model.layers.{i}.{hf_name}", ("layers", i, *path), transpose
    yield "model.norm.weight", ("final_norm", "scale"), False
    if not cfg.tie_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


# Tensors some checkpoints carry that are not weights of the model.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
