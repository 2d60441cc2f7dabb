"""Qwen3-MoE Hugging Face folders (Qwen3MoeForCausalLM): logit parity with transformers,
bit-for-bit round trips, config.json as transformers writes it, one-line errors.

The fixtures (tests/fixtures/hf/qwen3_moe_tiny_*) and their FP32 logits come from
scripts/qwen3_moe_reference.py (real transformers, run under a Python with torch); this
suite needs no torch. The one test that does (an export loaded back into transformers)
runs only where LP_JAX_TORCH_PYTHON names a Python with torch and transformers."""
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from lp_jax.errors import UserError
from lp_jax.training.validate import resolve
from models import hf, hf_cli, llama, moe
from models.hf_config import HFError, config_from_hf, config_to_hf
from tests.models.test_hf import FIXTURES, UNTIED, _tensors
from tests.models.test_model_registry import tiny

F32 = os.path.join(FIXTURES, "qwen3_moe_tiny_f32")  # norm_topk_prob true, untied, one file
BF16 = os.path.join(FIXTURES, "qwen3_moe_tiny_bf16_sharded")  # false, tied, head_dim 16, 2 shards
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(REPO, "scripts", "qwen3_moe_reference.py")  # runs under a Python with torch
# Measured: 1.3e-6 (F32) and 1.1e-5 (BF16, logits up to 34) against transformers, about
# 3.5e-7 of the largest logit; the bound leaves room for another CPU's FP32 sums.
PARITY = 1e-5


def _logits(model, tokens):
    """FP32 logits, run eagerly: every model here has the same few op shapes, compiled once
    (a jit would compile each model's graph anew)."""
    return np.asarray(model(jnp.asarray(tokens))[0], np.float32)


def _error(model, ref):
    return np.abs(_logits(model, ref["tokens"]) - ref["logits"]).max() / np.abs(ref["logits"]).max()


def _with_params(model, change):
    """A copy of `model` with `change(layer)` applied to each of its layers (a control that
    changes one thing in the weights, so that it runs the same compiled forward)."""
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    for layer in other.layers:
        change(layer)
    return other


def _unit_q_norm(layer):
    layer.attn.q_norm.scale[...] = jnp.ones_like(layer.attn.q_norm.scale[...])


def _gate_up_swapped(layer):
    gate, up = jnp.split(layer.mlp.gate_up.kernel[...], 2, axis=-1)
    layer.mlp.gate_up.kernel[...] = jnp.concatenate([up, gate], axis=-1)


@pytest.mark.parametrize("folder", [F32, BF16])
def test_fp32_logits_match_transformers(folder):
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    model = hf.load_hf(folder, dtype=jnp.float32)
    cfg = model.config
    assert isinstance(model, moe.Qwen3MoE) and cfg.qk_norm and cfg.num_kv_heads == 2
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 16)
    # The fixtures take norm_topk_prob either way: a model that ignored it fails one of them.
    assert cfg.norm_topk_prob == (folder == F32) and cfg.tie_embeddings == (folder == BF16)
    assert np.abs(ref["logits"]).max() > 1.0
    assert _error(model, ref) < PARITY
    # Controls, each far off: QK-norm's scales replaced by ones, gate and up swapped in the
    # fused expert kernel.
    for change in (_unit_q_norm, _gate_up_swapped):
        assert _error(_with_params(model, change), ref) > 1e-3


@pytest.mark.parametrize("folder", [F32, BF16])
def test_fused_projections_keep_parity(folder):
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    fused = hf.load_hf(folder, dtype=jnp.float32, fused_projections=True)
    assert hasattr(fused.layers[0].attn, "qkv") and not hasattr(fused.layers[0].attn, "q_proj")
    np.testing.assert_array_equal(_logits(fused, ref["tokens"]),
                                  _logits(hf.load_hf(folder, dtype=jnp.float32), ref["tokens"]))


def test_expert_weights_land_in_the_grouped_kernels():
    """transformers' expert e: gate_proj [F, D], up_proj [F, D], down_proj [D, F]; the MoE's
    gate_up [E, D, 2F] holds gate's columns then up's, down [E, F, D], router [D, E]."""
    tensors = load_file(os.path.join(F32, "model.safetensors"))
    layer = hf.load_hf(F32, dtype=jnp.float32).layers[1].mlp
    gate_up, down = np.asarray(layer.gate_up.kernel[...]), np.asarray(layer.down.kernel[...])
    for e in range(4):
        hf_name = f"model.layers.1.mlp.experts.{e}."
        np.testing.assert_array_equal(gate_up[e, :, :16], tensors[hf_name + "gate_proj.weight"].T)
        np.testing.assert_array_equal(gate_up[e, :, 16:], tensors[hf_name + "up_proj.weight"].T)
        np.testing.assert_array_equal(down[e], tensors[hf_name + "down_proj.weight"].T)
    router = np.asarray(layer.router.kernel[...])
    np.testing.assert_array_equal(router, tensors["model.layers.1.mlp.gate.weight"].T)


def test_round_trips_are_bit_for_bit_and_config_json_is_transformers(tmp_path):
    model = hf.load_hf(F32, dtype=jnp.float32)
    hf.save_hf(model, tmp_path / "f32")
    assert _tensors(tmp_path / "f32") == _tensors(F32)
    fused = hf.load_hf(BF16, fused_projections=True)
    hf.save_hf(fused, tmp_path / "bf16", dtype=jnp.bfloat16, max_shard_size="30KB")
    assert _tensors(tmp_path / "bf16") == _tensors(BF16)
    assert "lm_head.weight" not in _tensors(tmp_path / "bf16")
    index = json.load(open(tmp_path / "bf16" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    for folder, out in ((F32, tmp_path / "f32"), (BF16, tmp_path / "bf16")):
        written = json.load(open(os.path.join(folder, "config.json")))
        ours = json.load(open(out / "config.json"))
        # Every key transformers 4.57 wrote, with its value, but its metadata and token ids
        # (which save_hf takes as extra_config); beyond them only RoPE and the dtype as
        # transformers 5.x names them.
        metadata = {"transformers_version", "use_cache", "bos_token_id", "eos_token_id"}
        kept = set(written) - metadata
        assert {k: ours[k] for k in kept} == {k: written[k] for k in kept}
        assert set(ours) - set(written) == {"rope_parameters", "torch_dtype"}
        cfg = config_from_hf(ours, dtype=jnp.float32, param_dtype=jnp.float32)
        assert cfg == config_from_hf(written, dtype=jnp.float32, param_dtype=jnp.float32)


def test_config_maps_to_lp_jax_fields_and_qwen3_30b_a3b_round_trips():
    written = json.load(open(os.path.join(F32, "config.json")))
    cfg = config_from_hf({**written, "router_aux_loss_coef": 0.02}, dtype=jnp.float32,
                         param_dtype=jnp.float32)
    assert (cfg.qk_norm, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size,
            cfg.norm_topk_prob, cfg.moe_aux_loss_coeff) == (True, 4, 2, 16, True, 0.02)
    assert cfg.intermediate_size == 64 and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    # Keys a config.json leaves out take Qwen3MoeConfig's defaults (norm_topk_prob false).
    sparse = {k: v for k, v in written.items() if k != "norm_topk_prob"}
    assert not config_from_hf(sparse, dtype=jnp.float32, param_dtype=jnp.float32).norm_topk_prob
    big = moe.preset("qwen3_30b_a3b")
    back = config_from_hf(config_to_hf(big, "bfloat16"), dtype=big.dtype, param_dtype=big.param_dtype)
    assert back == big


def test_dense_llama_stays_as_it_was():
    """qk_norm defaults to off: the Llama has the same parameters and the same export."""
    cfg = llama.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=8)
    dense = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    params = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(dense))}
    assert not any("q_norm" in p or "k_norm" in p for p in params)
    normed = nnx.eval_shape(lambda: llama.Llama(cfg.replace(qk_norm=True), rngs=nnx.Rngs(0)))
    assert normed.layers[0].attn.q_norm.scale.shape == (8,)


def _copy(tmp_path, src=F32):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    d = json.load(open(folder / "config.json"))
    d.update(changes)
    json.dump(d, open(folder / "config.json", "w"))


def _rewrite(folder, fn):
    file = folder / "model.safetensors"
    save_file(fn(load_file(file)), file, metadata={"format": "pt"})


def _drop(name):
    return lambda d: _rewrite(d, lambda t: {k: v for k, v in t.items() if k != name})


@pytest.mark.parametrize("breakage, message", [
    (lambda d: _edit_config(d, use_sliding_window=True, sliding_window=8),
     r"unsupported use_sliding_window=true in config\.json; lp_jax attends to the whole context"),
    (lambda d: _edit_config(d, shared_expert_intermediate_size=32),
     r"unsupported shared_expert_intermediate_size=32 in config\.json; lp_jax's MoE has no shared experts"),
    (lambda d: _edit_config(d, decoder_sparse_step=2),
     r"config\.json makes layers \[0\] dense \(decoder_sparse_step=2, mlp_only_layers=\[\]\); lp_jax's MoE "
     r"has experts in every layer"),
    (lambda d: _edit_config(d, mlp_only_layers=[1]), r"config\.json makes layers \[1\] dense"),
    (lambda d: _edit_config(d, num_experts_per_tok=5),
     r"num_experts_per_tok=5; it must be between 1 and num_experts=4"),
    (lambda d: _edit_config(d, num_experts=1), r"num_experts=1; lp_jax's MoE needs at least 2"),
    (lambda d: _edit_config(d, architectures=["LlamaForCausalLM"]),
     r"config\.json's architectures \['LlamaForCausalLM'\] do not match its model_type 'qwen3_moe'"),
    (lambda d: _edit_config(d, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"]),
     r"unsupported architecture \['Qwen2MoeForCausalLM'\] in config\.json; supported: LlamaForCausalLM, "
     r"Qwen3MoeForCausalLM"),
    (lambda d: _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"unsupported rope_type 'yarn'"),
    (lambda d: _edit_config(d, moe_intermediate_size=8),
     r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape \(16, 32\) but config\.json "
     r"implies \(8, 32\)"),
    (_drop("model.layers.1.mlp.experts.3.up_proj.weight"),
     r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"),
    (_drop("model.layers.0.self_attn.k_norm.weight"),
     r"missing tensor model\.layers\.0\.self_attn\.k_norm\.weight"),
    (lambda d: _rewrite(d, lambda t: {**t, "model.layers.0.mlp.shared_expert.up_proj.weight":
                                      np.zeros((8, 32), np.float32)}),
     r"unexpected tensor model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight in .* \(not a weight of a "
     r"Qwen3MoeForCausalLM with this config\.json; 1 in all\)"),
])
def test_bad_input_gives_one_line_error(tmp_path, breakage, message):
    folder = _copy(tmp_path)
    breakage(folder)
    with pytest.raises(HFError, match=message) as err:
        hf.load_hf(folder)
    assert "\n" not in str(err.value)


def test_models_without_an_hf_architecture_are_refused(tmp_path):
    # Refused before any parameter is read: abstract models do.
    no_qk = nnx.eval_shape(lambda: moe.Qwen3MoE(moe.preset("tiny", num_layers=1), rngs=nnx.Rngs(0)))
    with pytest.raises(HFError, match=r"^a model with no QK-norm and experts has no Hugging Face "
                                      r"architecture here: Qwen3MoeForCausalLM norms q and k "
                                      r"\(model.qk_norm=true\)$"):
        hf.save_hf(no_qk, tmp_path / "a")
    normed = nnx.eval_shape(lambda: llama.Llama(llama.preset("tiny", num_layers=1, qk_norm=True),
                                                rngs=nnx.Rngs(0)))
    with pytest.raises(HFError, match=r"^a model with QK-norm and no experts has no Hugging Face"):
        hf.save_hf(normed, tmp_path / "b")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_cli_import_export_round_trip(tmp_path):
    assert hf_cli.main(["import", BF16, str(tmp_path / "ckpt")]) == 0
    restored = hf.load_state_checkpoint(tmp_path / "ckpt")
    assert isinstance(restored, moe.Qwen3MoE) and restored.config == hf.load_hf(BF16).config
    assert hf_cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert _tensors(tmp_path / "out") == _tensors(BF16)
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["bos_token_id"] == 1 and config["architectures"] == ["Qwen3MoeForCausalLM"]


def _moe_folder(tmp_path, vocab_size=384):
    """A Qwen3-MoE folder that lp_jax wrote, big enough for the byte tokenizer's ids."""
    cfg = moe.preset("tiny", num_layers=2, vocab_size=vocab_size, qk_norm=True, norm_topk_prob=False)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: moe.Qwen3MoE(cfg, rngs=nnx.Rngs(0))))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # the values do not matter here
    hf.save_hf(nnx.merge(graphdef, zeros), tmp_path / "qwen")
    return tmp_path / "qwen", cfg


def test_init_hf_takes_a_qwen3_moe_folder_for_model_type_moe(tmp_path, token_cache):
    folder, cfg = _moe_folder(tmp_path)
    plan = resolve(tiny(tmp_path / "run", token_cache, "model.type=moe", f"init.hf={folder}"),
                   check_files=False)
    assert plan.model_config == cfg.replace(dtype=plan.model_config.dtype)
    for overrides, message in [
        ([f"init.hf={folder}"], f"init.hf={folder}: the folder holds a Qwen3MoeForCausalLM, which "
                                "model.type=moe builds, not model.type='llama'"),
        (["model.type=moe", f"init.hf={UNTIED}"], f"init.hf={UNTIED}: the folder holds a LlamaForCausalLM, "
                                                  "which model.type=llama builds, not model.type='moe'"),
        (["model.type=moe", f"init.hf={folder}", "model.num_experts=4"],
         f"model.num_experts=4 does not fit the weights of init.hf={folder} (num_experts 8); leave it unset"),
        (["model.type=moe", f"init.hf={folder}", "model.qk_norm=false"],
         f"model.qk_norm=False does not fit the weights of init.hf={folder} (qk_norm True); leave it unset"),
    ]:
        with pytest.raises(UserError) as e:
            resolve(tiny(tmp_path / "run", token_cache, *overrides), check_files=False)
        assert str(e.value) == message


def _random_scale(model, seed):
    """lp_jax's init (std 0.02) gives logits near zero: weights at unit scale, norms near 1."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var[...].shape
        if path[-1] == "scale":
            var[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(shape), jnp.float32)
        else:
            fan_in = shape[-2] if path[-1] == "kernel" else 1
            var[...] = jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LP_JAX_TORCH_PYTHON"),
                    reason="set LP_JAX_TORCH_PYTHON to a Python with torch and transformers")
@pytest.mark.parametrize("norm_topk_prob, tie", [(False, True), (True, False)])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, norm_topk_prob, tie):
    """An lp_jax model exported by save_hf, loaded by transformers' Qwen3MoeForCausalLM
    (scripts/qwen3_moe_reference.py under LP_JAX_TORCH_PYTHON): the same FP32 logits."""
    cfg = moe.preset("tiny", num_layers=2, vocab_size=96, hidden_size=48, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=24,
                     qk_norm=True, norm_topk_prob=norm_topk_prob, tie_embeddings=tie, dtype=jnp.float32)
    model = moe.Qwen3MoE(cfg, rngs=nnx.Rngs(7))
    _random_scale(model, seed=7)
    hf.save_hf(model, tmp_path / "hf", max_shard_size="40KB")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    save_file({"tokens": tokens}, tmp_path / "tokens.safetensors")
    done = subprocess.run([os.environ["LP_JAX_TORCH_PYTHON"], REFERENCE, "logits", str(tmp_path / "hf"),
                           str(tmp_path / "tokens.safetensors"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    print(done.stdout, file=sys.stderr)
    assert "Qwen3MoeForCausalLM" in done.stdout
    # Beyond Qwen3MoeConfig's fields: head_dim (an attribute its attention reads, which
    # transformers writes too: the fixtures have it), and RoPE and the dtype under the names
    # of transformers 5.x and of 4.x before 4.56 (as the Llama export writes them).
    assert "are not Qwen3MoeConfig fields: ['head_dim', 'rope_parameters', 'torch_dtype']" in done.stdout
    theirs, ours = load_file(tmp_path / "out.safetensors")["logits"], _logits(model, tokens)
    error = np.abs(theirs - ours).max() / np.abs(theirs).max()
    print(f"norm_topk_prob={norm_topk_prob} tie={tie}: |logits| max {np.abs(theirs).max():.3f}, "
          f"max |lp_jax - transformers| {np.abs(theirs - ours).max():.3g} ({error:.3g} of it)",
          file=sys.stderr)
    assert np.abs(theirs).max() > 1.0 and error < PARITY
