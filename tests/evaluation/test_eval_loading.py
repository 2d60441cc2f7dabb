"""Loading what evaluation scores: tokenizer.json adapter, run folders (Orbax)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from lp_jax.data.tokenizers import HFTokenizerFile
from lp_jax.evaluation import loading
from lp_jax.evaluation.pair_encoding import PairEncoder
from tests.support.eval_toys import write_byte_level_tokenizer


def test_tokenizer_json_prefix_token_is_the_harness_bos(tmp_path):
    write_byte_level_tokenizer(tmp_path / "tokenizer.json", with_bos=True)
    tok = HFTokenizerFile(str(tmp_path))
    assert tok.bos_id == 0  # <|begin_of_text|>, which encode() leaves out
    assert 0 not in tok.encode("Answer: the answer")
    ctx, cont = PairEncoder(tok, 64).encode_pair("Question: what?\nAnswer:", " the answer")
    assert ctx[0] == 0 and ctx + cont == [0] + tok.encode("Question: what?\nAnswer: the answer")
    write_byte_level_tokenizer(tmp_path / "plain.json", with_bos=False)
    assert HFTokenizerFile(str(tmp_path / "plain.json")).bos_id is None  # GPT-2 style


class Toy(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(4, 6, rngs=rngs)


def _save_run(run_dir, model, step, layout="model"):
    """layout "model": item `state` is the model's nnx.State; "train": the trainer's
    train-state dict (params, rest, optimizer moments, counters) plus a `meta` item."""
    manager = ocp.CheckpointManager(str(run_dir / "checkpoints"))
    items = {}
    if layout == "model":
        items["state"] = ocp.args.StandardSave(nnx.state(model))
    else:
        _, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.adamw(1e-3)
        items["state"] = ocp.args.StandardSave(
            {"params": params, "rest": rest, "opt_state": tx.init(params),
             "step": jnp.array(step), "rng": jax.random.key_data(jax.random.key(0))})
        items["meta"] = ocp.args.JsonSave({"recipe": "nvfp4"})
    manager.save(step, args=ocp.args.Composite(**items))
    manager.wait_until_finished()
    manager.close()


@pytest.mark.parametrize("layout", ["model", "train"])
def test_run_dir_restores_the_latest_model_state(tmp_path, layout):
    trained = Toy(nnx.Rngs(7))
    _save_run(tmp_path, Toy(nnx.Rngs(1)), 2, layout)
    _save_run(tmp_path, trained, 5, layout)
    abstract = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
    model, step = loading.restore_model_state(abstract, str(tmp_path / "checkpoints"))
    assert step == 5
    np.testing.assert_array_equal(model.proj.kernel[...], trained.proj.kernel[...])


def test_run_dir_errors(tmp_path):
    with pytest.raises(loading.UserError, match="not a training run folder \\(no config.yaml\\)"):
        loading.load_from_run_dir(str(tmp_path))
    (tmp_path / "config.yaml").write_text("model: {hidden_size: 8}\n")
    with pytest.raises(loading.UserError, match="no checkpoints"):
        loading.load_from_run_dir(str(tmp_path))
    abstract = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
    with pytest.raises(loading.UserError, match="no checkpoint folder"):
        loading.restore_model_state(abstract, str(tmp_path / "checkpoints"))
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(loading.UserError, match="no checkpoint saved yet"):
        loading.restore_model_state(abstract, str(tmp_path / "checkpoints"))


def test_checkpoint_without_a_state_item(tmp_path):
    manager = ocp.CheckpointManager(str(tmp_path))
    manager.save(1, args=ocp.args.Composite(other=ocp.args.JsonSave({"a": 1})))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(loading.UserError, match="step 1: no readable item 'state'"):
        loading.restore_model_state(nnx.eval_shape(lambda: Toy(nnx.Rngs(0))), str(tmp_path))
