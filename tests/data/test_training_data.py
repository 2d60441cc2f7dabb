"""Packing, shards, prepare_data, the split by file, and the grain iterator."""
import json
import os

import numpy as np
import pytest

from lp_jax.data import pipeline as data
from lp_jax.data import prepare_data, shards
from lp_jax.data.tokenizers import ByteTokenizer

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def test_pack_sequence_marks_documents():
    # A document cut by the window start (ids 1,2), then two whole documents.
    window = np.array([1, 2, EOS, BOS, 5, 6, EOS, BOS, 8])
    ex = data.pack_sequence(window, BOS)
    np.testing.assert_array_equal(ex["tokens"], window[:-1])
    np.testing.assert_array_equal(ex["targets"], window[1:])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 2, 2, 2, 2, 3])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 0, 1, 2, 3, 0])
    # Targets that open another document (the BOS after an EOS) are not trained on.
    np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 0, 1, 1, 1, 0, 1])
    assert ex["tokens"].dtype == np.int32 and ex["loss_mask"].dtype == bool


def test_packed_sequences_index_across_shards():
    a, b = np.arange(100, 121), np.arange(200, 210)  # 21 and 10 tokens
    src = data.PackedSequences([a, b], seq_len=4, bos_id=-1)
    assert len(src) == 5 + 2  # (21-1)//4 + (10-1)//4
    np.testing.assert_array_equal(src[1]["tokens"], [104, 105, 106, 107])
    np.testing.assert_array_equal(src[1]["targets"], [105, 106, 107, 108])
    np.testing.assert_array_equal(src[5]["tokens"], [200, 201, 202, 203])
    np.testing.assert_array_equal(src[6]["targets"], [205, 206, 207, 208])


def _write_texts(folder, n=6):
    texts = {}
    for i in range(n):
        path = folder / f"doc{i}.txt"
        texts[str(path)] = f"document {i}: " + "héllo wörld " * (i + 3)
        path.write_text(texts[str(path)], encoding="utf-8")
    return texts


@pytest.mark.parametrize("fmt", ["npy", "bin"])
def test_prepare_writes_shards_that_decode_to_the_text(tmp_path, fmt):
    texts = _write_texts(tmp_path / "in" if (tmp_path / "in").mkdir() is None else None)
    files = sorted(texts)
    train, val = prepare_data.split_by_file(files, str(tmp_path / "in"), 0.34)
    assert val and train and not set(train) & set(val) and sorted(train + val) == files
    meta = prepare_data.prepare(train, val, ByteTokenizer(), tmp_path / "out", fmt=fmt,
                                shard_tokens=100, progress=False)
    assert meta["tokenizer"] == "bytes" and meta["dtype"] == "uint16"
    assert len(meta["splits"]["train"]["shards"]) > 1  # 100-token shards
    paths = [str(tmp_path / "out" / p) for p in meta["splits"]["train"]["shards"]]
    stream = np.concatenate(shards.open_shards(paths, "uint16"))
    assert len(stream) == meta["splits"]["train"]["tokens"]
    docs = np.split(stream, np.flatnonzero(stream == BOS)[1:])
    assert [ByteTokenizer().decode(d) for d in docs] == [texts[f] for f in train]
    assert all(d[0] == BOS and d[-1] == EOS for d in docs)
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta


def test_split_by_file_is_stable_and_needs_two_files(tmp_path):
    files = [f"/x/{i}.py" for i in range(40)]
    train, val = prepare_data.split_by_file(files, "/x", 0.25)
    assert 3 <= len(val) <= 20 and sorted(train + val) == sorted(files)
    # A file's side depends on its own name: adding files never moves an existing one.
    more = files + [f"/x/new{i}.py" for i in range(40)]
    train2, val2 = prepare_data.split_by_file(more, "/x", 0.25)
    assert set(val) <= set(val2) and set(train) <= set(train2)
    assert len(prepare_data.split_by_file(files[:2], "/x", 0.01)[1]) == 1  # never empty
    assert prepare_data.split_by_file(files, "/x", 0.0) == (files, [])
    with pytest.raises(ValueError, match="at least 2 files"):
        prepare_data.split_by_file(files[:1], "/x", 0.1)


def test_stdlib_is_the_default_text():
    files, root = prepare_data.stdlib_files()
    assert len(files) > 500 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f.split(os.sep) for f in files)
    assert os.path.join(root, "os.py") in files


def test_text_cache_is_built_once(tmp_path, monkeypatch):
    _write_texts(tmp_path)
    args = ([str(tmp_path / "*.txt")], [], 0.2, ByteTokenizer(), str(tmp_path / "cache"), False)
    found = prepare_data.text_shards(*args)
    train, val, binary = found.train, found.val, found.binary
    assert train and val and binary == []
    monkeypatch.setattr(prepare_data, "prepare", lambda *a, **k: pytest.fail("re-tokenized"))
    again = prepare_data.text_shards(*args)
    assert (again.train, again.val, again.binary) == (train, val, [])
    (tmp_path / "doc0.txt").write_text("changed")  # a changed file is a new cache entry
    monkeypatch.undo()
    assert prepare_data.text_shards(*args).train != train


def test_prepare_data_cli(tmp_path, capsys):
    _write_texts(tmp_path)
    out = tmp_path / "shards"
    assert prepare_data.main([str(tmp_path / "*.txt"), "--out", str(out), "--no-progress"]) == 0
    assert "train: 5 files" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["meta.json", "train_00000.npy", "val_00000.npy"]
    with pytest.raises(SystemExit) as info:
        prepare_data.main([str(tmp_path / "*.nothing"), "--out", str(out)])
    assert info.value.code == 2


def test_train_iterator_is_seeded_and_resumes_exactly():
    src = data.PackedSequences([np.arange(2000) % 250], seq_len=8, bos_id=-1)

    def first(seed, n):
        it = data.train_iterator(src, seed, 4, read_threads=1)
        return [next(it)["tokens"] for _ in range(n)], it

    a, _ = first(0, 3)
    b, it = first(0, 3)
    c, _ = first(1, 3)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not all((x == y).all() for x, y in zip(a, c))
    state = it.get_state()
    expected = [next(it)["tokens"] for _ in range(2)]
    resumed = data.train_iterator(src, 0, 4, read_threads=0)
    resumed.set_state(state)
    assert all((next(resumed)["tokens"] == e).all() for e in expected)


def test_epochs_are_reshuffled_and_cover_everything():
    src = data.PackedSequences([np.arange(81)], seq_len=8, bos_id=-1)  # 10 sequences
    it = data.train_iterator(src, 0, 5, read_threads=0)
    epoch1 = np.concatenate([next(it)["tokens"][:, 0] for _ in range(2)])
    epoch2 = np.concatenate([next(it)["tokens"][:, 0] for _ in range(2)])
    assert sorted(epoch1) == sorted(epoch2) == list(range(0, 80, 8))
    assert list(epoch1) != list(epoch2)


def test_mock_and_validation_batches_are_deterministic():
    mock = data.MockSequences(vocab_size=300, seq_len=16, seed=3)
    np.testing.assert_array_equal(mock[7]["tokens"], data.MockSequences(300, 16, 3)[7]["tokens"])
    assert mock[7]["tokens"].max() < 300 and not (mock[7]["tokens"] == mock[8]["tokens"]).all()
    v1 = data.validation_batches(mock, 4, 2)
    v2 = data.validation_batches(mock, 4, 2)
    assert len(v1) == 2 and v1[1]["tokens"].shape == (4, 16)
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(v1, v2))
