"""Reference logits from the real transformers Qwen3MoeForCausalLM (run under a Python with
torch and transformers, e.g. Python 3.11 with the CPU build of torch).

Not part of the test suite (which needs no torch): it makes the committed Qwen3-MoE parity
fixtures in tests/fixtures/hf/ and checks that a folder lp_jax exported loads in transformers.

    python3.11 -m venv .venv311          # from the repository root; .gitignore covers it
    .venv311/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors numpy
    .venv311/bin/python scripts/qwen3_moe_reference.py fixtures tests/fixtures/hf
    .venv311/bin/python scripts/qwen3_moe_reference.py logits HF_DIR TOKENS.safetensors OUT.safetensors

`fixtures` writes two tiny random models (4 experts, 2 per token, QK-norm, GQA 2:1), each
with `reference.safetensors` holding `tokens` [2, 16] and transformers' FP32 `logits`
[2, 16, vocab] computed from the folder as saved:

- qwen3_moe_tiny_f32: norm_topk_prob true, untied head, FP32, one file;
- qwen3_moe_tiny_bf16_sharded: norm_topk_prob false, tied embeddings, head_dim 16 (the
  attention width 64 is not the hidden size 32), BF16 weights in shards with an index.

`logits` loads any folder with AutoModelForCausalLM in FP32 (eager attention), writes its
logits on the given tokens, and names every config.json key that is not a field of the
folder's transformers config class.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

from hf_reference import load_fp32, random_model  # scripts/, beside this file

TOKENS_SHAPE = (2, 16)
VOCAB = 128


def _config(*, norm_topk_prob: bool, tie: bool, head_dim: int) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_theta=1_000_000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, bos_token_id=1, eos_token_id=2)


def _random_model(config, seed: int) -> transformers.Qwen3MoeForCausalLM:
    # Unit-scale weights (hf_reference.random_model): the router then picks its top 2
    # clear-cut, and the QK-norm scales around 1 are visible in the logits.
    return random_model(config, seed, transformers.Qwen3MoeForCausalLM)


def _load(folder: str):
    return load_fp32(folder, transformers.AutoModelForCausalLM)


def reference_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _load(folder)(tokens).logits.float()


def make_fixtures(out_dir: str) -> None:
    gen = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, VOCAB, TOKENS_SHAPE, generator=gen, dtype=torch.int64)
    f32 = os.path.join(out_dir, "qwen3_moe_tiny_f32")
    _random_model(_config(norm_topk_prob=True, tie=False, head_dim=8), seed=0).save_pretrained(
        f32, safe_serialization=True)
    bf16 = os.path.join(out_dir, "qwen3_moe_tiny_bf16_sharded")
    model = _random_model(_config(norm_topk_prob=False, tie=True, head_dim=16), seed=1)
    model.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True, max_shard_size="30KB")
    for folder in (f32, bf16):
        if os.path.exists(os.path.join(folder, "generation_config.json")):
            os.remove(os.path.join(folder, "generation_config.json"))  # not needed to load
        logits = reference_logits(folder, tokens)
        save_file({"tokens": tokens.to(torch.int32), "logits": logits.contiguous()},
                  os.path.join(folder, "reference.safetensors"))
        print(f"{folder}: files {sorted(os.listdir(folder))}, |logits| max {logits.abs().max():.3f}")


def unknown_config_keys(folder: str) -> list[str]:
    """config.json keys that are not fields of the folder's transformers config class (the
    keys of its default config's to_dict())."""
    with open(os.path.join(folder, "config.json")) as f:
        written = json.load(f)
    fields = transformers.AutoConfig.for_model(written["model_type"]).to_dict()
    return sorted(set(written) - set(fields))


def logits_for(folder: str, tokens_file: str, out_file: str) -> None:
    tokens = load_file(tokens_file)["tokens"].to(torch.int64)
    model = _load(folder)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    save_file({"tokens": tokens.to(torch.int32), "logits": logits.contiguous()}, out_file)
    print(f"transformers {transformers.__version__}: {type(model).__name__}; config.json keys "
          f"that are not {type(model.config).__name__} fields: {unknown_config_keys(folder)}; "
          f"wrote {out_file}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "fixtures":
        make_fixtures(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "logits":
        logits_for(*sys.argv[2:])
    else:
        sys.exit(__doc__)
