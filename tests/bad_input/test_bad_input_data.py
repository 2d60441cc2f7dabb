"""Bad data (docs/bad_input.md, cases 1, 2, 7, 8): refused with one line naming the file,
exit 2, before the run folder is written; binary text files are skipped and counted; the
token cache follows the files' content."""
import os

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data import pipeline as data
from lp_jax.data.prepare_data import text_shards
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.errors import UserError
from tests.support.bad_input import ROOT, only_line, tiny, train

TOKENS = ["data.source=tokens", "data.val_paths=[]"]


def test_token_ids_outside_the_vocabulary_stop_before_training(tmp_path, token_cache, capsys):
    shard = tmp_path / "ids.npy"  # ids up to 60,000 for a model of 384
    np.save(shard, np.random.default_rng(0).integers(0, 60_000, 50_000).astype(np.uint16))
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *TOKENS, f"data.paths=[{shard}]"))
    assert rc == 2
    line = only_line(err)
    assert str(shard) in line and "outside the model's vocabulary of 384 ids" in line
    assert not (tmp_path / "run").exists()


def test_an_id_deep_in_a_shard_is_caught_when_its_sequence_is_read():
    ids = np.arange(1000) % 300
    ids[700] = 384  # past the first sequence, which is checked up front
    source = data.PackedSequences([ids], seq_len=32, bos_id=256, vocab_size=384,
                                  names=["deep.npy"])
    source[0], source[20]  # sequences without it read as usual
    with pytest.raises(UserError, match=r"'deep.npy' holds id 384 at token 700, outside"):
        source[700 // 32]


def test_float_npy_shards_are_not_tokens(tmp_path, token_cache, capsys):
    shard = tmp_path / "floats.npy"
    np.save(shard, np.random.default_rng(0).random(50_000, dtype=np.float32))
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *TOKENS, f"data.paths=[{shard}]"))
    assert rc == 2
    assert f"data.paths: token shard '{shard}' holds float32 values, not integer token ids" in only_line(err)
    assert not (tmp_path / "run").exists()


def _npy_bytes(n=5_000):
    import io

    buffer = io.BytesIO()
    np.save(buffer, (np.arange(n) % 250).astype(np.uint16))
    return buffer.getvalue()


@pytest.mark.parametrize("name, content", [
    ("truncated.npy", _npy_bytes()[:4_000]),
    ("cut_header.npy", _npy_bytes()[:60]),
    ("garbage.npy", b"not an array at all " * 50),
    ("odd.bin", b"\x01\x00\x02"),  # 1.5 uint16 tokens
])
def test_damaged_token_shards_are_named(name, content, tmp_path, token_cache, capsys):
    shard = tmp_path / name
    shard.write_bytes(content)
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *TOKENS, f"data.paths=[{shard}]"))
    assert rc == 2
    line = only_line(err)
    assert f"token shard '{shard}' is not readable as" in line and "truncated or damaged" in line
    assert not (tmp_path / "run").exists()


def test_tokens_shorter_than_one_sequence(tmp_path, token_cache, capsys):
    shard = tmp_path / "short.npy"
    np.save(shard, np.arange(20, dtype=np.uint16))  # seq_len 32 needs 33
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, *TOKENS, f"data.paths=[{shard}]"))
    assert rc == 2
    assert "20 training tokens, fewer than one sequence of data.seq_len + 1 = 33" in only_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("files, val_fraction, message", [
    (1, 0.0, "3 training tokens, fewer than one sequence of data.seq_len + 1 = 33"),
    (1, 0.05, "a validation split by file needs at least 2 files, got 1"),
])
def test_text_shorter_than_one_sequence(files, val_fraction, message, tmp_path, token_cache, capsys):
    for i in range(files):
        (tmp_path / f"t{i}.txt").write_text("x")  # BOS, x, EOS
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, f"data.paths=[{tmp_path}/*.txt]",
                                    f"data.val_fraction={val_fraction}"))
    assert rc == 2
    assert message in only_line(err)
    assert not (tmp_path / "run").exists()  # no config.yaml, no checkpoints/


@pytest.mark.parametrize("what, message", [
    ("file", "is not a valid tokenizer.json: key must be a string at line 1 column 2"),
    ("folder", "is a folder; name the tokenizer.json in it"),
])
def test_bad_hf_tokenizer(what, message, tmp_path, token_cache, capsys):
    path = tmp_path / "tok"
    if what == "file":
        path.write_text("{not json")
    else:
        path.mkdir()
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, f"data.tokenizer=hf:{path}"))
    assert rc == 2
    line = only_line(err)
    assert line.startswith(f"train.py: error: data.tokenizer: tokenizer file '{path}'") and message in line
    assert not (tmp_path / "run").exists()


def _word_tokenizer(folder, block=None, bos=None, regex=None):
    """A small tokenizer.json built here (no download), with a truncation or padding block,
    a tokenizer_config.json naming `bos` as its BOS token, or a pre-tokenizer splitting by
    `regex`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("def return if".split())}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = (pre_tokenizers.Whitespace() if regex is None
                        else pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    if block == "truncation":
        hf.enable_truncation(max_length=8)
    elif block == "padding":
        hf.enable_padding(pad_id=0, pad_token="<unk>")
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    if bos is not None:
        (folder / "tokenizer_config.json").write_text(f'{{"bos_token": "{bos}", "eos_token": "</s>"}}')
    return folder / "tokenizer.json"


@pytest.mark.parametrize("block, effect", [("truncation", "cut every document to its max_length"),
                                           ("padding", "pad every document with pad ids")])
def test_a_tokenizer_that_cuts_or_pads_documents_is_refused(block, effect, tmp_path, token_cache,
                                                             capsys):
    path = _word_tokenizer(tmp_path / "tok", block=block)
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, f"data.tokenizer=hf:{path}"))
    assert rc == 2
    assert only_line(err) == (f"train.py: error: data.tokenizer: tokenizer file '{path}' has a "
                              f"'{block}' block, which would {effect}; set \"{block}\": null in it")
    assert not (tmp_path / "run").exists()


def test_a_configured_bos_token_missing_from_the_vocabulary_is_refused(tmp_path, token_cache, capsys):
    # Without the check, BOS would silently be <s>, which the config does not name.
    path = _word_tokenizer(tmp_path / "tok", bos="<|begin_of_text|>")
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, f"data.tokenizer=hf:{path}"))
    assert rc == 2
    assert only_line(err) == (
        f"train.py: error: data.tokenizer: '{tmp_path / 'tok' / 'tokenizer_config.json'}' names "
        f"bos_token '<|begin_of_text|>', which tokenizer 'hf:{path}' does not have")
    assert not (tmp_path / "run").exists()


BACKTRACKS = "its pre-tokenizer regex backtracks without end (Rust panicked: Onig: Regex search " \
             "error: retry-limit-in-match over); fix or remove the regex"


def test_a_tokenizer_regex_that_backtracks_without_end_is_one_line(tmp_path, token_cache, capfd):
    """Oniguruma gives up on such a regex by panicking, and Rust prints its report (a whole
    backtrace under RUST_BACKTRACE=1) before Python sees the panic: the tokenizer is tried on
    probe texts as it loads, with that report held back."""
    path = _word_tokenizer(tmp_path / "tok", regex=r"(\w+\s?)+$")
    for name in ("a.txt", "b.txt"):  # text it panics on, as the probe does
        (tmp_path / name).write_text("def return if " * 8 + "!\n")
    rc, _, err = train(capfd, tiny(tmp_path / "run", token_cache, f"data.tokenizer=hf:{path}",
                                   f"data.paths=[{tmp_path}/*.txt]"))
    assert rc == 2
    assert only_line(err) == (f"train.py: error: data.tokenizer: tokenizer file '{path}' panics "
                              f"on 'a' 48 times, then '!': {BACKTRACKS}")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_panic_the_probes_miss_is_one_line_naming_the_file(tmp_path, capfd):
    """A regex that only a rarer text breaks (no probe is a run of 'q'): the panic on that
    text is one line naming the corpus file, after Rust's own report, which nothing can
    hold back there; no Python traceback, no meta.json."""
    from lp_jax.data import prepare_data

    path = _word_tokenizer(tmp_path / "tok", regex=r"((q+)+)+z")
    corpus = tmp_path / "qqq.txt"
    corpus.write_text("def " + "q" * 40 + "\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        prepare_data.main([str(corpus), "--tokenizer", f"hf:{path}", "--out", str(out),
                           "--val-fraction", "0", "--no-progress", "--jobs", "1"])
    assert info.value.code == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"python -m lp_jax.data.prepare_data: error: {corpus}: "
                                    f"tokenizer file '{path}' cannot encode a text: {BACKTRACKS}")
    assert not (out / "meta.json").exists()


def test_binary_files_among_the_text_are_skipped_and_counted(tmp_path, token_cache):
    texts = {f"doc{i}.txt": f"text number {i}\n" * (20 + i) for i in range(3)}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "image.txt").write_bytes(bytes(range(256)) * 8)  # NUL bytes: binary
    config = load_config(None, [f"data.paths=[{tmp_path}/*.txt]", "data.val_fraction=0",
                                f"data.cache_dir={token_cache}", "data.seq_len=32"])
    splits = data.open_splits(config.data, ByteTokenizer(), 384, seed=0, progress=False)
    assert "skipped 1 binary file(s), e.g. " + str(tmp_path / "image.txt") in splits.description
    # BOS + bytes + EOS per text file, and not one byte of the binary one.
    assert sum(len(a) for a in splits.train.arrays) == sum(len(t) + 2 for t in texts.values())


def test_invalid_utf8_in_the_text_is_counted_in_the_data_line(tmp_path, token_cache):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and more text\n" * 20)
    (tmp_path / "b.txt").write_text("text that is UTF-8\n" * 20)
    config = load_config(None, [f"data.paths=[{tmp_path}/*.txt]", "data.val_fraction=0",
                                f"data.cache_dir={token_cache}", "data.seq_len=32"])
    for _ in range(2):  # tokenized, then read from the cache: the count comes with it
        splits = data.open_splits(config.data, ByteTokenizer(), 384, seed=0, progress=False)
        assert splits.description.endswith(
            f"; replaced 20 invalid UTF-8 byte sequence(s) with U+FFFD in 1 file(s), most in "
            f"{tmp_path / 'a.txt'} (20)")


def test_only_binary_files_is_an_error(tmp_path, token_cache, capsys):
    (tmp_path / "a.bin.txt").write_bytes(b"\x00\x01" * 100)
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache, f"data.paths=[{tmp_path}/*.txt]"))
    assert rc == 2
    assert "data.paths: the 1 file(s) matching" in only_line(err) and "are all binary" in err


def test_a_damaged_shard_is_one_line_from_the_real_command(tmp_path, token_cache):
    """The same as above through `python train.py`, as a user meets it: one line, exit 2."""
    import subprocess
    import sys

    shard = tmp_path / "truncated.npy"
    shard.write_bytes(_npy_bytes()[:4_000])
    argv = tiny(tmp_path / "run", token_cache, *TOKENS, f"data.paths=[{shard}]")
    proc = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"train.py: error: data.paths: token shard '{shard}'")
    assert proc.stderr.count("\n") == 1


def test_a_text_file_edited_with_the_same_size_and_time_is_tokenized_again(tmp_path):
    """The token cache is keyed by each file's content: an edit that keeps the size and
    the modification time (a tool that restores mtimes, a copy with `cp -p`) used to be
    served the old tokens."""
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 40)
    args = ([str(tmp_path / "*.txt")], [], 0.3, ByteTokenizer(), str(tmp_path / "cache"), False)

    def tokens():
        found = text_shards(*args)
        return np.concatenate([np.load(p) for p in found.train + found.val])

    assert ord("D") not in tokens()
    doc = tmp_path / "doc0.txt"
    before = doc.stat()
    doc.write_text(doc.read_text().replace("document", "DOCUMENT"))
    os.utime(doc, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = doc.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert np.count_nonzero(tokens() == ord("D")) == 40
