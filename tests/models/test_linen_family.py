"""docs/your_model.md's Linen, plain-JAX and bridge examples run as written: Hugging Face's
Flax GPT-2 trained through apply_recipe_linen, lp.dot_general in plain JAX, and a Linen model
wrapped by Flax's NNX bridge, registered by import path and trained by train.py in NVFP4 with
its last block in BF16 (and resumed). The bridge gives the NNX model exactly what the Linen
model gives through apply_recipe_linen; a model keeping nnx.Rngs is refused in one line."""
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax import model_registry
from lp_jax.errors import UserError
from models import config as model_config
from tests.training.test_training_loop import TEXT

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "your_model.md").read_text()


def _python_block(heading: str) -> str:
    section = DOC.split(heading, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_plain_jax_example_runs(capsys):
    exec(compile(_python_block("## Plain JAX"), "docs/your_model.md", "exec"), {})
    assert "'up': (dtype('float32'), (128, 256))" in capsys.readouterr().out


@pytest.mark.slow
def test_the_hugging_face_linen_example_runs(capsys):
    pytest.importorskip("transformers")
    scope = {}
    exec(compile(_python_block("## Linen models"), "docs/your_model.md", "exec"), scope)
    first = capsys.readouterr().out.splitlines()[0]
    assert "(container 'transformer/h'): 12 GEMMs run NVFP4BlockScaling, 4 kept in BF16" in first
    assert np.isfinite(float(scope["loss"]))


BRIDGE = _python_block("### Example: a Linen model through Flax's NNX bridge")


def _bridge_module(tmp_path, name="linen_lm"):
    (tmp_path / f"{name}.py").write_text(BRIDGE)
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.slow
def test_the_bridge_runs_what_apply_recipe_linen_runs(tmp_path):
    mod = _bridge_module(tmp_path, "linen_lm_same")
    cfg = model_config.preset("tiny", num_layers=4)
    model = mod.BridgedLM(cfg, nnx.Rngs(0))
    recipe = lp.get_recipe("nvfp4", policy="F0L1")
    report = lp.apply_recipe(model, recipe)
    assert list(report.bridged) == ["lm"] and "bridged at 'lm'" in str(report)
    tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, cfg.vocab_size)
    got = nnx.jit(lambda m, t: m(t))(model, tokens)
    linen = report.bridged["lm"]
    assert lp.linen_report(linen).layer_container == "layers"
    assert sorted(lp.linen_report(linen).bf16_by_policy) == ["layers_3/down", "layers_3/up"]
    params = nnx.to_pure_dict(nnx.state(model.lm, nnx.Param))
    want = jax.jit(lambda p, t: lp.apply_recipe_linen(mod.LinenLM(cfg.vocab_size, cfg.hidden_size,
                                                                  cfg.intermediate_size, 4), recipe)
                   .apply({"params": p}, t))(params, tokens)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_model_keeping_rngs_is_refused(tmp_path):
    mod = _bridge_module(tmp_path, "linen_lm_rngs")

    class KeepsRngs(mod.BridgedLM):
        def __init__(self, cfg, rngs):
            super().__init__(cfg, rngs)
            self.lm.to_nnx__rngs = rngs.fork()

    model_registry.register_model_family("keeps_rngs", type("F", (), {"build": lambda self, c, r: KeepsRngs(c, r)})())
    try:
        with pytest.raises(UserError, match=r"^model.type='keeps_rngs': the model keeps nnx.Rngs state \(lm/"):
            model_registry.build_model("keeps_rngs", model_config.preset("tiny"), nnx.Rngs(0))
    finally:
        model_registry.unregister_model_family("keeps_rngs")


def _train_py(tmp_path, token_cache, steps):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "configs/tiny.yaml", "model.type=linen_lm:LinenFamily",
         "precision=nvfp4", "precision.last_bf16_layers=1", f"steps={steps}", f"run_dir={tmp_path / 'run'}",
         f"data.paths={TEXT}", f"data.cache_dir={token_cache}", "data.val_fraction=0.2", "data.seq_len=64",
         "data.global_batch_size=4", "data.micro_batch_size=4", "schedule.warmup_steps=1",
         "logging.val_batches=0", "logging.progress_bar=false", "logging.tensorboard=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_train_py_trains_and_resumes_the_bridged_linen_model(tmp_path, token_cache):
    (tmp_path / "linen_lm.py").write_text(BRIDGE)
    out = _train_py(tmp_path, token_cache, 2)
    assert re.search(r"^lm \(Linen\): recipe NVFP4BlockScaling \(F0L1\) over 4 layers \(container 'layers'\): 6 "
                     r"GEMMs run NVFP4BlockScaling, 2 kept in BF16 by the layer policy", out, re.M), out
    assert out.splitlines()[-1].startswith("step 2/2: loss "), out
    out = _train_py(tmp_path, token_cache, 3)
    assert "resumed from step 2" in out and out.splitlines()[-1].startswith("step 3/3: loss "), out
