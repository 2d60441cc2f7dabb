"""Hugging Face import/export: logit parity with transformers, byte-identical round trips,
one-line errors. Fixtures come from scripts/hf_reference.py (real transformers, FP32)."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models import hf, hf_cli, llama
from models.hf_config import HFError, config_from_hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")
UNTIED = os.path.join(FIXTURES, "llama3_untied_f32")  # 5.x config, F32, one file
TIED = os.path.join(FIXTURES, "tied_bf16_sharded_v4")  # 4.x config, BF16, 3 shards + index


def _tensors(folder):
    """HF name -> (dtype code, shape, raw bytes) for every tensor of a folder."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors") and name != "reference.safetensors":
            with safe_open(os.path.join(folder, name), framework="numpy") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    out[key] = (f.get_slice(key).get_dtype(), t.shape, t.tobytes())
    return out


def _logits(model, tokens):
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)), np.float32)


@pytest.mark.parametrize("folder", [UNTIED, TIED])
def test_fp32_logits_match_transformers(folder):
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    model = hf.load_hf(folder, dtype=jnp.float32)
    assert model.config.rope_scaling is not None and model.config.num_kv_heads == 2
    assert model.config.tie_embeddings == (folder == TIED)
    out = _logits(model, ref["tokens"])
    assert np.abs(ref["logits"]).max() > 1.0  # a bound of 1e-4 means something at this scale
    assert np.abs(out - ref["logits"]).max() < 1e-4
    # Control: the same weights without Llama 3 RoPE scaling are far off (the test can fail).
    unscaled = llama.Llama(model.config.replace(rope_scaling=None), rngs=nnx.Rngs(0))
    nnx.update(unscaled, nnx.state(model))
    assert np.abs(_logits(unscaled, ref["tokens"]) - ref["logits"]).max() > 1e-2


def test_bf16_load_computes_in_bf16():
    ref = load_file(os.path.join(UNTIED, "reference.safetensors"))
    model = hf.load_hf(UNTIED)  # default dtype bfloat16, float32 master weights
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"]))
    assert logits.dtype == jnp.bfloat16 and model.embed.embedding[...].dtype == jnp.float32
    assert np.abs(np.asarray(logits, np.float32) - ref["logits"]).max() < 0.1


def test_import_export_is_byte_identical(tmp_path):
    model = hf.load_hf(UNTIED, dtype=jnp.float32)
    hf.save_hf(model, tmp_path / "f32")
    assert _tensors(tmp_path / "f32") == _tensors(UNTIED)
    tied = hf.load_hf(TIED)
    hf.save_hf(tied, tmp_path / "bf16", dtype=jnp.bfloat16, max_shard_size="20KB")
    assert _tensors(tmp_path / "bf16") == _tensors(TIED)
    assert "lm_head.weight" not in _tensors(tmp_path / "bf16")
    index = json.load(open(tmp_path / "bf16" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    config = json.load(open(tmp_path / "bf16" / "config.json"))
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and config["tie_word_embeddings"]
    # The written config reads back to the same model config, in either style.
    for style_keys in (("rope_parameters",), ("rope_theta", "rope_scaling")):
        d = {k: v for k, v in config.items() if k not in style_keys}
        assert config_from_hf(d, dtype=tied.config.dtype, param_dtype=tied.config.param_dtype) == tied.config


@pytest.mark.parametrize("folder", [UNTIED, TIED])
def test_fused_projections_keep_parity_and_round_trip(tmp_path, folder):
    """q/k/v and gate/up joined on import (Megatron's layout) and split on export: the same
    logits as transformers' and as the separate layout's, and the same tensors written."""
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    fused = hf.load_hf(folder, dtype=jnp.float32, fused_projections=True)
    attn, mlp = fused.layers[0].attn, fused.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    cfg = fused.config
    assert attn.qkv.kernel.shape == (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    assert mlp.gate_up.kernel.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
    out = _logits(fused, ref["tokens"])
    assert np.abs(out - ref["logits"]).max() < 1e-4
    np.testing.assert_array_equal(out, _logits(hf.load_hf(folder, dtype=jnp.float32), ref["tokens"]))
    dtype = jnp.float32 if folder == UNTIED else jnp.bfloat16
    hf.save_hf(fused, tmp_path / "out", dtype=dtype)
    assert _tensors(tmp_path / "out") == _tensors(folder)


def test_v4_and_v5_configs_read_alike():
    v5 = json.load(open(os.path.join(UNTIED, "config.json")))
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    params = dict(v5["rope_parameters"])
    v4["rope_theta"] = params.pop("rope_theta")
    v4["rope_scaling"] = params
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32)
    assert config_from_hf(v4, **kw) == config_from_hf(v5, **kw)
    plain = {**v4, "rope_scaling": None}
    assert config_from_hf(plain, **kw).rope_scaling is None
    assert config_from_hf(plain, **kw).rope_theta == 10000.0


def test_random_model_round_trip_and_cli(tmp_path, capsys):
    cfg = llama.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=8, dtype=jnp.float32)
    model = llama.Llama(cfg, rngs=nnx.Rngs(3))
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
    hf.save_hf(model, tmp_path / "hf", max_shard_size=4096)
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    np.testing.assert_array_equal(_logits(hf.load_hf(tmp_path / "hf", jnp.float32), tokens), _logits(model, tokens))
    # CLI: HF -> Orbax state checkpoint -> HF gives the same tensors and keeps extra config keys.
    assert hf_cli.main(["import", str(TIED), str(tmp_path / "ckpt")]) == 0
    assert hf_cli.main(["import", str(TIED), str(tmp_path / "ckpt")]) == 2  # never overwrites
    restored = hf.load_state_checkpoint(tmp_path / "ckpt")
    assert restored.config == hf.load_hf(TIED).config
    assert hf_cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert _tensors(tmp_path / "out") == _tensors(TIED)
    assert json.load(open(tmp_path / "out" / "config.json"))["bos_token_id"] == 1
    # A bare state checkpoint (no llama_config.json) exports given a preset.
    assert hf_cli.main(["export", str(tmp_path / "ckpt" / "state"), str(tmp_path / "x"),
                        "--preset", "tiny"]) == 2  # wrong architecture for these weights
    assert "cannot restore" in capsys.readouterr().err
    bare = llama.preset("tiny", num_layers=2, vocab_size=96, hidden_size=32, intermediate_size=64,
                        num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=True)
    assert hf.load_state_checkpoint(tmp_path / "ckpt" / "state", bare).config == bare


def _copy(tmp_path, src=UNTIED):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    path = folder / "config.json"
    d = json.load(open(path))
    d.update(changes)
    json.dump(d, open(path, "w"))


def _rewrite(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    save_file(fn(tensors), folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("breakage, message", [
    (lambda d: os.remove(d / "config.json"), r"missing file .*config\.json"),
    (lambda d: os.remove(d / "model.safetensors"), r"missing file .*model\.safetensors \(nor a sharded"),
    (lambda d: _edit_config(d, architectures=["MistralForCausalLM"]),
     r"unsupported architecture \['MistralForCausalLM'\] in config\.json; supported: LlamaForCausalLM"),
    (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     r"unsupported rope_type 'yarn' in config\.json; supported: 'default', 'llama3'"),
    (lambda d: _edit_config(d, intermediate_size=48),
     r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(64, 32\) but config\.json implies \(48, 32\)"),
    (lambda d: _rewrite(d, lambda t: {**t, "model.norm.weight": t["model.norm.weight"].astype(np.float64)}),
     r"tensor model\.norm\.weight has dtype F64, which cannot be represented here; supported: F32, BF16, F16"),
    (lambda d: _rewrite(d, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}),
     r"missing tensor lm_head\.weight"),
    (lambda d: _rewrite(d, lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
     r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias"),
    (lambda d: _edit_config(d, hidden_act="gelu"), r"unsupported hidden_act 'gelu'"),
])
def test_bad_input_gives_one_line_error(tmp_path, breakage, message):
    folder = _copy(tmp_path)
    breakage(folder)
    with pytest.raises(HFError, match=message) as err:
        hf.load_hf(folder)
    assert "\n" not in str(err.value)


def test_missing_shard_and_bad_dtypes(tmp_path):
    folder = _copy(tmp_path, TIED)
    os.remove(folder / "model-00002-of-00003.safetensors")
    with pytest.raises(HFError, match=r"missing file .*model-00002-of-00003\.safetensors \(listed in"):
        hf.load_hf(folder)
    with pytest.raises(HFError, match="dtype int8 cannot be represented; allowed: float32, bfloat16, float16"):
        hf.load_hf(UNTIED, dtype=jnp.int8)
    model = hf.load_hf(UNTIED)
    with pytest.raises(HFError, match="export dtype float64 cannot be represented"):
        hf.save_hf(model, tmp_path / "o", dtype=np.float64)
    big = model.embed.embedding[...].at[0, 0].set(1e6)
    model.embed.embedding[...] = big
    with pytest.raises(HFError, match="tensor model.embed_tokens.weight has values that float16 cannot represent"):
        hf.save_hf(model, tmp_path / "o", dtype=jnp.float16)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert hf_cli.main(["import", str(tmp_path / "nope"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: missing file") and err.count("\n") == 1
    assert hf_cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "nope: no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert hf_cli.main(["export", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2
    assert "llama_config.json" in capsys.readouterr().err
