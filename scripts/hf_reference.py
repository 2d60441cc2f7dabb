"""Reference logits from the real transformers LlamaForCausalLM (run under Python 3.11 + torch).

Not part of the test suite (which needs no torch): it makes the committed parity fixtures in
tests/fixtures/hf/ and checks that an exported folder loads in transformers.

    python3.11 -m venv .venv311          # from the repository root; .gitignore covers it
    .venv311/bin/pip install torch==2.13.0 transformers safetensors
    .venv311/bin/python scripts/hf_reference.py fixtures tests/fixtures/hf
    .venv311/bin/python scripts/hf_reference.py logits HF_DIR TOKENS.safetensors OUT.safetensors

Each fixture folder is a tiny random model (GQA, and Llama 3 RoPE scaling whose three frequency
bands all occur at head_dim 8) plus `reference.safetensors` holding `tokens` [2, 24] and
transformers' FP32 `logits` [2, 24, vocab] computed from the folder as saved.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

TOKENS_SHAPE = (2, 24)


def _config(tie: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_theta=10_000.0,
        # wavelengths 6.3, 63, 628, 6283 against 64/4=16 and 64/1=64: one kept, one smoothed,
        # two divided by the factor, so every branch of the llama3 rule is exercised.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2)


def random_model(config, seed: int, model_class=transformers.LlamaForCausalLM):
    """transformers' own init (std 0.02, norm scales 1) gives logits near zero, which would
    make a parity bound meaningless (and a QK-norm's scale invisible): re-draw weights at
    unit scale and every norm scale around 1 (scripts/qwen3_moe_reference.py uses it too)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 2:
                fan_in = p.shape[1]
                scale = 1.0 if "embed_tokens" in name else fan_in ** -0.5
                p.copy_(scale * torch.randn_like(p))
    return model


def load_fp32(folder: str, model_class=transformers.LlamaForCausalLM):
    """A saved folder in FP32 with eager attention, as the references are computed."""
    # transformers 4.x names the keyword torch_dtype; 5.x names it dtype.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return model_class.from_pretrained(folder, attn_implementation="eager", **{key: torch.float32}).eval()


def reference_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_fp32(folder)(tokens).logits.float()


def _to_v4_style(folder: str) -> None:
    """Rewrites config.json as transformers 4.x writes it (rope_theta + rope_scaling)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = None if params.get("rope_type") == "default" else params
    d["torch_dtype"] = d.pop("dtype", "float32")
    d["transformers_version"] = "4.57.1"
    with open(path, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)


def make_fixtures(out_dir: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, TOKENS_SHAPE, generator=gen, dtype=torch.int64)
    # 1. untied, FP32, one file, config.json as transformers 5.x writes it.
    untied = os.path.join(out_dir, "llama3_untied_f32")
    random_model(_config(tie=False), seed=0).save_pretrained(untied, safe_serialization=True)
    # 2. tied, BF16 weights in two shards with an index, config.json in 4.x style.
    tied = os.path.join(out_dir, "tied_bf16_sharded_v4")
    model = random_model(_config(tie=True), seed=1).to(torch.bfloat16)
    model.save_pretrained(tied, safe_serialization=True, max_shard_size="20KB")
    _to_v4_style(tied)
    for folder in (untied, tied):
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(folder, extra)):
                os.remove(os.path.join(folder, extra))  # not needed to load; keep fixtures small
        logits = reference_logits(folder, tokens)
        save_file({"tokens": tokens.to(torch.int32), "logits": logits.contiguous()},
                  os.path.join(folder, "reference.safetensors"))
        print(f"{folder}: files {sorted(os.listdir(folder))}, |logits| max {logits.abs().max():.3f}")


def logits_for(folder: str, tokens_file: str, out_file: str) -> None:
    tokens = load_file(tokens_file)["tokens"].to(torch.int64)
    save_file({"tokens": tokens.to(torch.int32), "logits": reference_logits(folder, tokens).contiguous()},
              out_file)
    print(f"transformers {transformers.__version__}: wrote {out_file}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "fixtures":
        make_fixtures(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "logits":
        logits_for(*sys.argv[2:])
    else:
        sys.exit(__doc__)
