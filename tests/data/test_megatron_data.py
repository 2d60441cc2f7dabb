"""Megatron-LM's indexed datasets: an .idx/.bin pair laid out byte by byte as Megatron's
_IndexWriter writes it (megatron/core/datasets/indexed_dataset.py) is read back, prepare_data
--format megatron writes exactly those bytes, data.source=megatron packs by the document
index, and a blend interleaves its datasets in the weights' proportions."""
import struct

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data import megatron, pipeline, prepare_data
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.errors import UserError
from tests.support.corpus_files import expected_stream, write_jsonl

UINT16, INT32 = 8, 4  # Megatron's DType codes


def megatron_pair(prefix, sequences, document_index, dtype=np.uint16, code=UINT16):
    """The .bin and .idx Megatron's IndexedDatasetBuilder writes for these sequences and
    document index, built field by field from the documented layout."""
    sequences = [np.asarray(s, dtype) for s in sequences]
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(s.tobytes())
    lengths = [len(s) for s in sequences]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))  # version
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(document_index)))
        f.write(np.array(lengths, "<i4").tobytes())
        f.write(np.array(pointers, "<i8").tobytes())
        f.write(np.array(document_index, "<i8").tobytes())
    return str(prefix)


def test_a_pair_written_as_megatron_does_is_read_by_its_document_index(tmp_path):
    # Three documents; the second has two sequences (sentences, --split-sentences).
    prefix = megatron_pair(tmp_path / "corpus", [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]],
                           [0, 1, 3, 4])
    dataset = megatron.open_indexed(prefix)
    np.testing.assert_array_equal(dataset.tokens, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert dataset.tokens.dtype == np.uint16 and isinstance(dataset.tokens, np.memmap)
    np.testing.assert_array_equal(dataset.document_starts, [0, 3, 6, 10])
    assert dataset.documents == 3
    wide = megatron_pair(tmp_path / "wide", [[70_000, 1], [2]], [0, 1, 2], np.int32, INT32)
    np.testing.assert_array_equal(megatron.open_indexed(wide).tokens, [70_000, 1, 2])


def test_prepare_data_writes_megatrons_bytes(tmp_path):
    texts = ["first document", "second, longer document", "third"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    assert prepare_data.main([str(tmp_path / "in.jsonl"), "--out", str(out), "--format", "megatron",
                              "--val-fraction", "0", "--no-progress", "--jobs", "1"]) == 0
    docs = [expected_stream(ByteTokenizer(), [t]) for t in texts]
    # preprocess_data's layout: one sequence per document, document index 0..n.
    megatron_pair(tmp_path / "reference", docs, list(range(len(docs) + 1)))
    for suffix in (".bin", ".idx"):
        assert (out / f"train_00000{suffix}").read_bytes() == (tmp_path / f"reference{suffix}").read_bytes()
    dataset = megatron.open_indexed(str(out / "train_00000"))
    np.testing.assert_array_equal(dataset.document_starts, [0, *np.cumsum([len(d) for d in docs])])


def _config(*overrides):
    return load_config(None, ["data.source=megatron", "data.seq_len=4", "data.val_fraction=0",
                              *overrides]).data


def test_training_sequences_take_their_documents_from_the_index(tmp_path):
    # No BOS anywhere: only the index says where the documents begin.
    prefix = megatron_pair(tmp_path / "c", [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], [0, 1, 2, 3])
    splits = pipeline.open_splits(_config(f"data.paths=[{prefix}]"), ByteTokenizer(), 259, seed=0)
    first = splits.train[0]  # tokens 1..5: documents start at tokens 1 and 4
    np.testing.assert_array_equal(first["tokens"], [1, 2, 3, 4])
    np.testing.assert_array_equal(first["segment_ids"], [2, 2, 2, 3])  # as after a BOS at 0
    np.testing.assert_array_equal(first["positions"], [0, 1, 2, 0])
    np.testing.assert_array_equal(first["loss_mask"], [1, 1, 0, 1])  # the target 4 opens a document
    # Megatron's split: the last val_fraction of the documents is validation.
    held = pipeline.open_splits(_config(f"data.paths=[{prefix}]", "data.val_fraction=0.34",
                                        "data.seq_len=1"), ByteTokenizer(), 259, seed=0)
    assert len(held.val) == 1 and held.val[0]["tokens"] == [9] and held.val[0]["targets"] == [10]
    assert sum(len(a) for a in held.train.arrays) == 8


def test_a_blend_keeps_the_weights_in_every_stretch(tmp_path):
    a = megatron_pair(tmp_path / "a", [np.arange(1, 41)], [0, 1])  # ids below 100
    b = megatron_pair(tmp_path / "b", [np.arange(101, 201)], [0, 1])
    config = _config(f"data.paths=[1, {a}, 3, {b}]")
    assert config.paths == ("1", a, "3", b)  # YAML's numbers kept as the blend's weights
    train = pipeline.open_splits(config, ByteTokenizer(), 259, seed=0).train
    assert isinstance(train, pipeline.BlendedSequences)
    # Megatron's rule: each slot to the dataset furthest behind its share.
    assert [train.source_of(i)[0] for i in range(8)] == [1, 0, 1, 1, 1, 0, 1, 1]
    from_a = [int(train[i]["tokens"][0]) < 100 for i in range(400)]
    for start in range(0, 400, 4):
        assert sum(from_a[start:start + 4]) == 1
    # a's 9 sequences come round again in another order; the blend is long enough for b's 24
    assert len(train) == max(9 * 4, -(-24 * 4 // 3))
    epoch = sorted(int(train[i]["tokens"][0]) for i in range(1, 36, 4))  # a's slots
    assert epoch == sorted(range(1, 37, 4))


@pytest.mark.parametrize("entries, message", [
    (["0.3", "a", "0.x7", "b"], "blend weight '0.x7' (entry 3 of data.paths) is not a number"),
    (["0.3", "a", "b"], "a blend is weight, prefix pairs, but data.paths has 3 entries"),
    (["0", "a", "1", "b"], "blend weight '0' (entry 1 of data.paths) must be a positive number"),
    (["1", "2", "3", "b"], "entry 2 of data.paths, '2', is a number where the blend needs"),
    (["a", "0.5", "b"], "data.paths mixes prefixes with the number '0.5'"),
])
def test_blend_parsing_refuses_what_does_not_parse(entries, message):
    with pytest.raises(ValueError) as info:
        megatron.parse_blend(entries)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_prefix_globs_and_file_names(tmp_path):
    for name in ("x_00000", "x_00001"):
        megatron_pair(tmp_path / name, [[1, 2]], [0, 1])
    assert megatron.expand_prefixes([str(tmp_path / "x_*")]) == [str(tmp_path / "x_00000"),
                                                                 str(tmp_path / "x_00001")]
    assert megatron.expand_prefixes([str(tmp_path / "x_00000.idx")]) == [str(tmp_path / "x_00000")]
    with pytest.raises(UserError, match="data.paths: .*does not exist"):
        pipeline.open_splits(_config(f"data.paths=[{tmp_path / 'nothing'}]"), ByteTokenizer(), 259, 0)
