"""Bad corpus files (docs/bad_input.md, case 16): prepare_data stops with one line naming the
file and the line or row, exit 2, and writes no meta.json; a Megatron index that does not
match its data, or a blend whose weights do not parse, stops train.py before the run folder
is written."""
import gzip
import json
import re

import numpy as np
import pyarrow as pa
import pytest

from lp_jax.data import prepare_data
from tests.data.test_megatron_data import megatron_pair
from tests.support.bad_input import only_line, tiny, train
from tests.support.corpus_files import write_arrow, write_jsonl, write_parquet


PREFIX = "python -m lp_jax.data.prepare_data: error: "


def _prepare_error(capsys, tmp_path, *args) -> str:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        prepare_data.main([*map(str, args), "--out", str(out), "--val-fraction", "0",
                           "--no-progress", "--jobs", "1"])
    assert info.value.code == 2
    assert not (out / "meta.json").exists()
    return only_line(capsys.readouterr().err, PREFIX)


def _zst(path, text: str, keep: float = 1.0):
    with pa.output_stream(str(path), compression="zstd") as f:
        f.write(text.encode())
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    return path


LINES = "".join(f'{{"text": "document {i}: {i * 7919 % 10007} {i ** 2} ' + "words " * 30 + '"}\n'
                for i in range(5000))


@pytest.mark.parametrize("name, content, message", [
    ("malformed.jsonl", '{"text": "ok"}\n{"text": "cut" "x"}\n',
     ":2: not a JSON line: Expecting ',' delimiter at column 16"),
    ("missing.jsonl", '{"text": "ok"}\n{"id": 7, "body": "x"}\n',
     ":2: no 'text' field (keys: id, body); --text-field names the field"),
    ("number.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"text": 5}\n',
     ":3: field 'text' holds int 5, not a string"),
    ("list.jsonl", '[1, 2]\n', ":1: a JSON line must hold an object, got list"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', ":1: not a JSON line"),
])
def test_bad_json_lines_name_file_and_line(name, content, message, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _prepare_error(capsys, tmp_path, path)
    assert f"{path}{message}" in line


def test_a_truncated_zstd_or_gzip_file_is_named(tmp_path, capsys):
    cut = _zst(tmp_path / "cut.jsonl.zst", LINES, keep=0.5)
    line = _prepare_error(capsys, tmp_path, cut)
    assert line.startswith(f"{PREFIX}{cut}: ")
    assert re.search(r"Truncated compressed stream after line [1-9][\d,]* \(truncated or damaged "
                     r"file\?\)$", line), line
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(LINES.encode())[:3000])
    assert f"{gz}: " in _prepare_error(capsys, tmp_path, gz)
    garbage = tmp_path / "garbage.jsonl.zst"
    garbage.write_bytes(b"not zstd at all " * 20)
    assert f"{garbage}: ZSTD decompress failed" in _prepare_error(capsys, tmp_path, garbage)


def test_a_parquet_or_arrow_file_without_the_text_column(tmp_path, capsys):
    parquet = write_parquet(tmp_path / "fineweb.parquet", ["a", "b"], field="content")
    line = _prepare_error(capsys, tmp_path, parquet)
    assert f"{parquet}: no column 'text' (columns: content, id); --text-field names the column" in line
    table = pa.table({"text": pa.array([1, 2], pa.int64())})
    numbers = tmp_path / "numbers.parquet"
    import pyarrow.parquet as pq

    pq.write_table(table, numbers)
    assert f"{numbers}: column 'text' holds int64, not strings" in _prepare_error(capsys, tmp_path, numbers)
    arrow = write_arrow(tmp_path / "data.arrow", ["x"], field="sentence")
    assert f"{arrow}: no column 'text' (columns: sentence)" in _prepare_error(capsys, tmp_path, arrow)
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(parquet.read_bytes()[:40])
    assert f"{damaged}: not readable as parquet" in _prepare_error(capsys, tmp_path, damaged)


def test_missing_fields_can_be_skipped_and_counted_instead(tmp_path, capsys):
    path = write_jsonl(tmp_path / "some.jsonl", [{"text": "kept"}, {"id": 1}])
    assert prepare_data.main([str(path), "--out", str(tmp_path / "out"), "--val-fraction", "0",
                              "--missing-field", "skip", "--no-progress", "--jobs", "1"]) == 0
    assert "skipped documents: 1 missing_field" in capsys.readouterr().out


# Four sequences that are not UTF-8 (a Latin-1 é, two bytes that start nothing, a lead
# byte cut off) and one U+FFFD written in UTF-8, which is text, not a replacement.
NOT_UTF8 = b"caf\xe9 \xff\xfe then \xc3 end; \xef\xbf\xbd is a character\n"


def test_invalid_utf8_in_a_text_file_is_replaced_and_counted(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(NOT_UTF8)
    (tmp_path / "good.txt").write_text("plain text\n")
    out = tmp_path / "out"
    assert prepare_data.main([str(tmp_path / "bad.txt"), str(tmp_path / "good.txt"),
                              "--out", str(out), "--val-fraction", "0", "--no-progress",
                              "--jobs", "1"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == ["replaced 4 invalid UTF-8 byte sequence(s) with U+FFFD in 1 "
                                "file(s), most in bad.txt (4)"]
    files = json.loads((out / "meta.json").read_text())["files"]
    assert files["bad.txt"]["replaced"] == {"invalid_utf8": 4}
    assert "replaced" not in files["good.txt"]
    tokens = np.load(out / "train_00000.npy")  # the byte tokenizer: what was trained on
    text = bytes(t for t in tokens.tolist() if t < 256).decode("utf-8")
    assert text == NOT_UTF8.decode("utf-8", errors="replace") + "plain text\n"
    assert text.count("\ufffd") == 5


def test_invalid_utf8_can_be_refused(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(NOT_UTF8)
    line = _prepare_error(capsys, tmp_path, tmp_path / "bad.txt", "--invalid-utf8", "error")
    assert line == (f"{PREFIX}{tmp_path / 'bad.txt'}: 4 byte sequence(s) that are not UTF-8, the "
                    "first at byte 3; --invalid-utf8 replace reads each as U+FFFD and counts them")


MEGATRON = ["data.source=megatron", "data.val_fraction=0"]


@pytest.mark.parametrize("damage, message", [
    ("short_bin", "does not match {prefix}.bin: its sequences hold 2,000 bytes of uint16 tokens, "
                  "the .bin has 1,998"),
    ("magic", "{prefix}.idx: not a Megatron index (starts b'MMIDIDX\\x00\\x01'"),
    ("counts", "{prefix}.idx: header counts 1,000 sequences"),
    ("doc_index", "{prefix}.idx: the document index must rise from 0 to the sequence count 4"),
])
def test_a_megatron_index_that_does_not_match_its_data(damage, message, tmp_path, token_cache, capsys):
    sequences = [np.arange(1, 251) % 250] * 4  # 1,000 uint16 tokens, 2,000 bytes
    prefix = megatron_pair(tmp_path / "corpus", sequences, [0, 1, 2, 3, 4])
    idx, bin_ = tmp_path / "corpus.idx", tmp_path / "corpus.bin"
    if damage == "short_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif damage == "magic":
        idx.write_bytes(b"MMIDIDX\x00\x01" + idx.read_bytes()[9:])
    elif damage == "counts":
        data = bytearray(idx.read_bytes())
        data[18:26] = (1000).to_bytes(8, "little")
        idx.write_bytes(bytes(data))
    else:  # the last document index entry points past the sequences
        megatron_pair(tmp_path / "corpus", sequences, [0, 1, 2, 5])
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *MEGATRON, f"data.paths=[{prefix}]"))
    assert rc == 2
    line = only_line(err)
    assert line.startswith("train.py: error: data.paths: ")
    assert message.format(prefix=prefix) in line
    assert not (tmp_path / "run").exists()


def test_a_blend_whose_weights_do_not_parse(tmp_path, token_cache, capsys):
    a = megatron_pair(tmp_path / "a", [np.arange(1, 200)], [0, 1])
    b = megatron_pair(tmp_path / "b", [np.arange(1, 200)], [0, 1])
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *MEGATRON,
                                    f"data.paths=[0.3, {a}, 0.7x, {b}]"))
    assert rc == 2
    assert ("train.py: error: data.paths: blend weight '0.7x' (entry 3 of data.paths) is not a "
            "number") in only_line(err)
    assert not (tmp_path / "run").exists()
