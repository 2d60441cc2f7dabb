"""Presets built abstractly (no 8B allocation): shapes, dtypes, counts; config validation."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import llama


def _abstract_params(cfg):
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    return {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", list(llama.PRESETS))
def test_preset_shapes_dtypes_and_count(name):
    cfg = llama.preset(name)
    params = _abstract_params(cfg)
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    last = cfg.num_layers - 1
    expected = {
        "embed/embedding": (cfg.vocab_size, d),
        f"layers/{last}/attn/q_proj/kernel": (d, q),
        f"layers/{last}/attn/k_proj/kernel": (d, kv),
        f"layers/{last}/attn/v_proj/kernel": (d, kv),
        f"layers/{last}/attn/o_proj/kernel": (q, d),
        f"layers/{last}/mlp/gate_proj/kernel": (d, cfg.intermediate_size),
        f"layers/{last}/mlp/up_proj/kernel": (d, cfg.intermediate_size),
        f"layers/{last}/mlp/down_proj/kernel": (cfg.intermediate_size, d),
        f"layers/{last}/attn_norm/scale": (d,),
        f"layers/{last}/mlp_norm/scale": (d,),
        "final_norm/scale": (d,),
    }
    for path, shape in expected.items():
        assert params[path].shape == shape, path
    assert ("lm_head/kernel" in params) == (not cfg.tie_embeddings)
    if not cfg.tie_embeddings:
        assert params["lm_head/kernel"].shape == (d, cfg.vocab_size)
    assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.float32)}
    assert sum(math.prod(v.shape) for v in params.values()) == llama.count_params(cfg)
    assert len([p for p in params if p.startswith(f"layers/{last}/")]) == 9
    assert not any(p.startswith(f"layers/{cfg.num_layers}/") for p in params)
    assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32


def test_llama3_8b_is_numerics_md():
    cfg = llama.preset("llama3_8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_embeddings, cfg.init_std) == (500000.0, 1e-5, False, 0.02)
    assert cfg.rope_scaling is None and cfg.max_seq_len == 8192
    assert llama.count_params(cfg) == 8_030_261_248  # Meta's published Llama 3 8B count
    assert llama.output_init_std(cfg) == pytest.approx(0.02 / 8)


def test_preset_sizes():
    billions = {n: llama.count_params(llama.preset(n)) / 1e9 for n in llama.PRESETS}
    assert 7.5 < billions["research_8b"] < 8.5
    assert billions["llama3_1b"] == pytest.approx(1.2358, abs=1e-3)  # Llama 3.2 1B
    assert 0.12 < billions["llama3_125m"] < 0.135
    assert billions["tiny"] < 0.002 and llama.preset("tiny").vocab_size >= 256 + 4


def test_flops_per_token():
    cfg = llama.preset("llama3_8b")
    n = llama.matmul_params(cfg)
    assert n == llama.count_params(cfg) - 2 * 4096 * 32 - 4096 - 128256 * 4096  # no norms, no lookup
    attn = 12 * 32 * 32 * 128 * 8192
    assert llama.flops_per_token(cfg, 8192) == 6 * n + attn
    assert llama.flops_per_token(cfg, 8192, causal=True) == 6 * n + attn / 2
    assert llama.flops_per_token(cfg, 8192, training=False) == 2 * n + attn / 3


def test_init_stds():
    cfg = llama.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=8,
                            num_heads=4, num_kv_heads=2, head_dim=64)
    params = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in
              nnx.to_flat_state(nnx.state(llama.Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param))}
    out_std = 0.02 / math.sqrt(16)
    for path, std in [("embed/embedding", 0.02), ("layers/3/attn/q_proj/kernel", 0.02),
                      ("layers/3/mlp/up_proj/kernel", 0.02), ("lm_head/kernel", 0.02),
                      ("layers/3/attn/o_proj/kernel", out_std), ("layers/3/mlp/down_proj/kernel", out_std)]:
        assert params[path].std() == pytest.approx(std, rel=0.05), path
    assert np.all(params["layers/0/attn_norm/scale"] == 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(remat="some"), "remat='some'; allowed: none, full"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_type 'yarn'"),
    (dict(rope_scaling={"factor": 8.0, "beta": 1}), "unknown llama3 rope_scaling keys ['beta']"),
    (dict(dtype="int8"), "dtype=int8 is not supported; allowed: float32, bfloat16"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(head_dim=7), "head_dim=7 must be even"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        llama.preset("tiny", **kwargs)


def test_preset_errors_and_conversions():
    with pytest.raises(ValueError, match="unknown preset 'huge'; available: tiny"):
        llama.preset("huge")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig fields \['layers'\]"):
        llama.preset("tiny", layers=3)
    cfg = llama.preset("tiny", dtype="float32", rope_scaling={"rope_type": "llama3", "factor": 4.0})
    assert cfg.dtype == jnp.float32 and cfg.rope_scaling.factor == 4.0
    hash(cfg)  # a static jit argument must hash
    assert llama.config_from_dict(llama.config_to_dict(cfg)) == cfg
    assert llama.preset("tiny", rope_scaling={"rope_type": "default"}).rope_scaling is None
    jax.jit(lambda x, c: x, static_argnums=1)(1.0, cfg)
