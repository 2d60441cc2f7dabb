"""prepare_data in parts and processes: the same tokens in the same order whatever the number
of parts (--worker I --workers N, then --merge) or of processes (--jobs); the merge refuses
parts that are missing or from another run; a failed run leaves no meta.json to trust."""
import json

import numpy as np
import pytest

from lp_jax.data import parts, prepare_data
from tests.support.corpus_files import documents, split_stream, write_jsonl, write_parquet


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(9):  # files of different sizes, two formats
        texts = documents(f"file{i}", 2 + 3 * (i % 4))
        if i % 3 == 2:
            write_parquet(folder / f"f{i}.parquet", texts)
        else:
            write_jsonl(folder / f"f{i}.jsonl", [{"text": t} for t in texts])
    return str(folder / "*")


def _run(corpus, out, *extra):
    args = [corpus, "--out", str(out), "--val-fraction", "0.2", "--shard-tokens", "300",
            "--no-progress", "--jobs", "1", *extra]
    assert prepare_data.main(args) == 0


def _streams(out):
    return {split: split_stream(out, split) for split in ("train", "val")}


@pytest.mark.parametrize("workers", [2, 4])
def test_parts_merge_to_the_tokens_of_one_run(corpus, tmp_path, workers, capsys):
    _run(corpus, tmp_path / "one")
    for index in reversed(range(workers)):  # any order
        _run(corpus, tmp_path / "parts", "--worker", str(index), "--workers", str(workers))
    assert prepare_data.main(["--merge", "--out", str(tmp_path / "parts")]) == 0
    one, merged = _streams(tmp_path / "one"), _streams(tmp_path / "parts")
    assert len(one["train"]) > 1000 and len(one["val"]) > 0
    for split in one:
        np.testing.assert_array_equal(merged[split], one[split])
    meta_one = json.loads((tmp_path / "one" / "meta.json").read_text())
    meta = json.loads((tmp_path / "parts" / "meta.json").read_text())
    assert meta["files"] == meta_one["files"] and meta["parts"] == workers
    assert all(s.startswith("part-") for s in meta["splits"]["train"]["shards"])
    for split in one:
        assert {k: v for k, v in meta["splits"][split].items() if k != "shards"} == {
            k: v for k, v in meta_one["splits"][split].items() if k != "shards"}
    assert f"{meta['splits']['train']['tokens']:,} tokens" in capsys.readouterr().out


def test_a_pool_of_processes_writes_the_same_shards(corpus, tmp_path):
    _run(corpus, tmp_path / "one")
    _run(corpus, tmp_path / "pool", "--jobs", "2")
    for split, stream in _streams(tmp_path / "one").items():
        np.testing.assert_array_equal(_streams(tmp_path / "pool")[split], stream)


def test_parts_are_contiguous_and_balanced_by_bytes():
    assert parts.part_of_each([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert parts.part_of_each([100, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert parts.part_of_each([0, 0, 0], 2) == [0, 0, 1]
    got = parts.part_of_each(list(range(1, 50)), 7)
    assert got == sorted(got) and set(got) == set(range(7))


def test_the_merge_refuses_missing_stale_or_foreign_parts(corpus, tmp_path, capsys):
    out = tmp_path / "parts"
    _run(corpus, out, "--worker", "0", "--workers", "3")
    _run(corpus, out, "--worker", "2", "--workers", "3")
    with pytest.raises(SystemExit):
        prepare_data.main(["--merge", "--out", str(out)])
    assert "part 1 of 3 is not finished" in capsys.readouterr().err
    _run(corpus, out, "--worker", "1", "--workers", "3", "--val-fraction", "0.3")
    with pytest.raises(SystemExit):
        prepare_data.main(["--merge", "--out", str(out)])
    assert "part 1 of 3 differs from part 0 in 'inputs'" in capsys.readouterr().err
    _run(corpus, out, "--worker", "1", "--workers", "3")
    _run(corpus, out, "--worker", "0", "--workers", "2")  # a stale run with another N
    with pytest.raises(SystemExit):
        prepare_data.main(["--merge", "--out", str(out)])
    assert "holds parts of runs with 2 and 3 workers" in capsys.readouterr().err
    assert not (out / "meta.json").exists()


def test_a_failed_run_leaves_no_meta_json(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    _run(corpus, out)
    assert (out / "meta.json").is_file()
    bad = tmp_path / "corpus" / "f9.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(SystemExit) as info:
        _run(corpus, out)
    assert info.value.code == 2
    assert f"{bad}:2: not a JSON line" in capsys.readouterr().err
    assert not (out / "meta.json").exists()  # the old one described shards now overwritten
    assert not list(out.glob(".*"))  # no temporary files left behind
