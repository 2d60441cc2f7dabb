"""An HF Llama folder read and run the way transformers' LlamaForCausalLM does, in NumPy.

Independent of models/: it reads config.json keys and safetensors tensor names exactly as
transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`) would, and
follows modeling_llama's eager forward (RMSNorm, rotate-half RoPE with the llama3 rule,
GQA, SwiGLU, a tied or separate head) in float64. test_hf_bridge checks it against the
transformers logits committed in tests/fixtures/hf, then uses it as transformers' stand-in
for folders exported from training runs (the test suite has no torch).
"""
import json
import os

import ml_dtypes  # noqa: F401 (registers bfloat16 with NumPy, for BF16 safetensors)
import numpy as np
from safetensors.numpy import load_file

# config.json keys LlamaConfig reads into the forward (the rest are ids and metadata).
FORWARD_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")


def read_folder(folder):
    """(config dict, {HF name: float64 array}) from config.json and the safetensors files."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(folder, name)))
    return config, {k: np.asarray(v, np.float64) for k, v in tensors.items()}


def _rope(config, style):
    """(theta, scaling dict or None) as transformers `style` ("v4" or "v5") reads them."""
    if style == "v5":
        params = dict(config["rope_parameters"])
        theta = params.pop("rope_theta")
        return theta, (None if params.get("rope_type") == "default" else params)
    return config["rope_theta"], config.get("rope_scaling")


def inv_freq(config, style):
    """transformers' _compute_default_rope_parameters / _compute_llama3_parameters."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta, scaling = _rope(config, style)
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return freq
    assert scaling["rope_type"] == "llama3"
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freq
    scaled = np.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled)


def _rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def logits(folder, tokens_BxL, style="v5"):
    """float64 logits [B, L, vocab] of the folder's model on `tokens_BxL` (positions 0..L-1)."""
    config, w = read_folder(folder)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["hidden_act"] == "silu"
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    eps = config["rms_norm_eps"]
    B, L = tokens_BxL.shape
    angles = np.arange(L)[:, None] * inv_freq(config, style)[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    causal = np.tril(np.ones((L, L), bool))
    x = w["model.embed_tokens.weight"][tokens_BxL]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, L, heads, head_dim)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, L, kv, head_dim)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, L, kv, head_dim)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, L, heads * head_dim)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
