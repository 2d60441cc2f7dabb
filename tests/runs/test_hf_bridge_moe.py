"""A model.type=moe training run to a Qwen3-MoE Hugging Face folder and back:
`python -m lp_jax.export RUN_DIR`, then `init.hf` (tests/runs/test_hf_bridge.py does the same
for the Llama). Slow: two tiny MoE runs compile (about a minute each on 2 cores)."""
import json
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from lp_jax import export
from lp_jax.runs.run_folder import open_and_restore
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve
from models import hf, moe
from models.hf_config import tensor_map
from models.hf_experts import split_experts
from tests.models.test_hf_qwen3_moe import PARITY, REFERENCE
from tests.models.test_model_registry import tiny
from tests.runs.test_hf_bridge import _hf_files

MOE = ("model.type=moe", "model.num_layers=2", "model.qk_norm=true", "model.norm_topk_prob=false")


def _params(model):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
def test_moe_run_exports_as_qwen3_moe_and_starts_a_run(tmp_path, token_cache):
    run(resolve(tiny(tmp_path / "src", token_cache, *MOE, "steps=2", "checkpoint.every=2")))
    assert export.main([str(tmp_path / "src"), str(tmp_path / "hf")]) == 0
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is False
    shape = (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"])
    assert shape == (8, 2, 96)
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    # The tensors are the run's FP32 masters, experts cut out of the grouped kernels.
    saved, trained = open_and_restore(str(tmp_path / "src"))
    cfg = saved.model_config
    masters, exported = split_experts(_params(trained), cfg), _hf_files(tmp_path / "hf")
    names = list(tensor_map(cfg))
    assert len(exported) == len(names) and any("experts.7.down_proj" in n for n, _, _ in names)
    for name, path, transpose in names:
        np.testing.assert_array_equal(exported[name], masters[path].T if transpose else masters[path])
    # load_hf computes what the run's own model computes, bit for bit.
    tokens = jnp.asarray(np.arange(48, dtype=np.int32).reshape(2, 24) * 5 % 256)
    loaded = hf.load_hf(str(tmp_path / "hf"), dtype=jnp.float32)
    ours = np.asarray(trained(tokens)[0])
    np.testing.assert_array_equal(np.asarray(loaded(tokens)[0]), ours)
    if os.environ.get("LP_JAX_TORCH_PYTHON"):  # and transformers, where a Python with torch is named
        save_file({"tokens": np.asarray(tokens)}, tmp_path / "tokens.safetensors")
        subprocess.run([os.environ["LP_JAX_TORCH_PYTHON"], REFERENCE, "logits", str(tmp_path / "hf"),
                        str(tmp_path / "tokens.safetensors"), str(tmp_path / "theirs.safetensors")],
                       check=True, capture_output=True, timeout=600)
        theirs = load_file(tmp_path / "theirs.safetensors")["logits"]
        assert np.abs(theirs - ours).max() < PARITY * np.abs(theirs).max()
    # init.hf: a new MoE run whose first step (at learning rate 0) keeps the exported weights.
    new = tiny(tmp_path / "new", token_cache, "model.type=moe", f"init.hf={tmp_path / 'hf'}",
               "steps=2", "stop_at=1")
    plan = resolve(new)
    assert plan.model_config == cfg and isinstance(trained, moe.Qwen3MoE)
    run(plan)
    assert read_metrics(tmp_path / "new")[0]["lr"] == 0.0
    _, started = open_and_restore(str(tmp_path / "new"))
    after = _params(started)
    assert all(np.array_equal(after[p], v) for p, v in _params(trained).items())
