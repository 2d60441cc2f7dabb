"""Data and tokenizers changed under a resume (docs/bad_input.md, case 21): the checkpoint's
data fingerprint (lp_jax/data/fingerprint.py) names what changed, and the resume is refused
in one line, checkpoints untouched, unless data.allow_changed=true says so."""
import glob
import json
import os
import shutil

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data import pipeline
from lp_jax.data.tokenizers import ByteTokenizer
from tests.support.bad_input import TEXT, error_line, run, stopped_run, tiny, train  # noqa: F401 (fixtures)
from tests.support.eval_toys import write_byte_level_tokenizer


def _steps(run_dir) -> list[str]:
    return sorted(os.listdir(run_dir / "checkpoints"))


@pytest.fixture
def data(tmp_path):
    """A copy of the text the stopped run trained on (the same files under another folder:
    the same data, since files are named relative to their folder)."""
    folder = tmp_path / "data"
    folder.mkdir()
    for path in glob.glob(TEXT):
        shutil.copy(path, folder)
    return folder


def _append(folder):
    with open(folder / "decoder.py", "a") as f:
        f.write("# one more line\n")


def _truncate(folder):
    path = folder / "decoder.py"
    path.write_bytes(path.read_bytes()[:1000])


def _same_size_edit(folder):
    path = folder / "decoder.py"
    text = path.read_bytes()
    path.write_bytes(text.replace(b"import", b"IMPORT"))
    assert path.stat().st_size == len(text)


CHANGES = {
    "appended": (_append, "file(s) changed: 'decoder.py' ("),
    "truncated": (_truncate, "file(s) changed: 'decoder.py' ("),
    "edited, same size": (_same_size_edit, "file(s) changed: 'decoder.py' (same size, other content)"),
    "file added": (lambda d: (d / "extra.py").write_text("x = 1\n" * 400), "file(s) added: 'extra.py'"),
    "file removed": (lambda d: (d / "decoder.py").unlink(), "file(s) removed: 'decoder.py'"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_text_refuses_the_resume(change, run, data, token_cache, capsys):
    """Before, each of these resumed ("resumed from step 4"), exit 0, with the stored stream
    position pointing into other sequences."""
    alter, named = CHANGES[change]
    alter(data)
    rc, out, err = train(capsys, tiny(run, token_cache, f"data.paths=[{data}/*.py]"))
    assert rc == 2, err
    line = error_line(err)
    assert line.startswith(f"train.py: error: checkpoint 4 in {str(run / 'checkpoints')!r} was "
                           "trained on other data: "), line
    assert named in line
    assert line.endswith("or set data.allow_changed=true to go on at the same position of the "
                         "new data's stream")
    assert "resumed" not in out
    assert _steps(run) == ["2", "4"]


@pytest.mark.slow  # three resumed runs
def test_the_same_data_elsewhere_resumes_and_a_change_can_be_allowed(run, data, token_cache, capsys):
    rc, out, err = train(capsys, tiny(run, token_cache, f"data.paths=[{data}/*.py]", "stop_at=5"))
    assert rc == 0, err
    assert "resumed from step 4" in out and "data" not in err
    _append(data)
    rc, out, err = train(capsys, tiny(run, token_cache, f"data.paths=[{data}/*.py]",
                                      "data.allow_changed=true"))
    assert rc == 0, err
    warning = [line for line in out.splitlines() if "allow_changed" in line]
    assert len(warning) == 1 and "file(s) changed: 'decoder.py' (" in warning[0], out
    assert "the stream goes on at sequence 10 of the new data's order" in warning[0]
    assert "config differs" not in out  # data.allow_changed is a key of the session
    # Its checkpoints record the new data: the next resume needs no permission.
    rc, out, err = train(capsys, tiny(run, token_cache, f"data.paths=[{data}/*.py]", "steps=7"))
    assert rc == 0, err
    assert "resumed from step 6" in out


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_note(run, token_cache, capsys):
    meta = run / "checkpoints" / "4" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    assert "data_fingerprint" in saved
    del saved["data_fingerprint"]  # as written before checkpoints recorded one
    meta.write_text(json.dumps(saved))
    rc, out, err = train(capsys, tiny(run, token_cache, "stop_at=5"))
    assert rc == 0, err
    notes = [line for line in out.splitlines() if "fingerprint" in line]
    assert notes == ["note: checkpoint 4 records no data fingerprint (saved before checkpoints "
                     "did), so a change of data or tokenizer since cannot be detected"]


@pytest.mark.slow  # a run of its own, with another tokenizer
def test_a_tokenizer_swapped_for_one_of_the_same_size_refuses_the_resume(tmp_path, token_cache,
                                                                         capsys):
    """Before: one generic warning at most (none at all for the same file name), and the
    embedding rows then meant other tokens."""
    from tokenizers import Tokenizer

    tokenizer = tmp_path / "tokenizer.json"
    first = write_byte_level_tokenizer(tokenizer, with_bos=False)
    run_dir = tmp_path / "run"
    argv = tiny(run_dir, token_cache, f"data.tokenizer=hf:{tokenizer}")
    assert train(capsys, [*argv, "stop_at=2"])[0] == 0
    _swap_two_ids(tokenizer)
    assert Tokenizer.from_file(str(tokenizer)).get_vocab_size() == first.get_vocab_size()
    rc, out, err = train(capsys, argv)
    assert rc == 2, err
    line = error_line(err)
    assert f"was trained on other data: tokenizer 'hf:{tokenizer}' has other content (sha256 " in line
    assert _steps(run_dir) == ["2"]


def _swap_two_ids(path) -> None:
    """The tokenizer.json with the ids of two of its tokens exchanged: the same size, the
    same tokens, but two ids that now mean the other's token."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    path.write_text(json.dumps(tokenizer))


def test_changed_token_shards_are_named(tmp_path):
    """Token shards get sampled hashes (size, first and last MiB): an append, a shard
    removed or added shows."""
    from lp_jax.data import fingerprint

    ids = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)
    for name in ("a", "b", "c"):
        np.save(tmp_path / f"{name}.npy", ids)
    config = load_config(None, ["data.source=tokens", f"data.paths=[{tmp_path}/*.npy]",
                                "data.seq_len=32"])

    def reads():
        splits = pipeline.open_splits(config.data, ByteTokenizer(), 384, seed=0, progress=False)
        return fingerprint.fingerprint(config.data, ByteTokenizer(), 0, splits.files)

    before = reads()
    assert sorted(before["files"]["train"]) == ["a.npy", "b.npy", "c.npy"]
    assert fingerprint.changes(before, reads()) == []
    np.save(tmp_path / "b.npy", np.concatenate([ids, ids[:64]]))
    (tmp_path / "c.npy").unlink()
    np.save(tmp_path / "d.npy", ids)
    assert fingerprint.changes(before, reads()) == [
        "train file(s) removed: 'c.npy'", "train file(s) added: 'd.npy'",
        "train file(s) changed: 'b.npy' (6128 -> 6256 bytes)"]
