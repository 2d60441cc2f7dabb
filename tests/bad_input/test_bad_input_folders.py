"""Config files and run folders that cannot be used (docs/bad_input.md, cases 4 and 7):
one line naming the path, exit 2, before anything is compiled or written.

Root ignores permission bits, so "cannot be read/written" is made with what fails for
root too: a path through a file, a folder of a pseudo file system, a file whose reads
fail. The chmod variants run only for other users."""
import os

import pytest

from lp_jax.runs.writable import write_problem
from tests.support.bad_input import only_line, tiny, train

ROOT_USER = os.geteuid() == 0


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "is a folder, not a YAML file"),
    (lambda p: p.write_bytes(b"steps: 3\nrun_dir: caf\xe9\n"), "is not UTF-8 text (byte 0xe9 at offset 21)"),
])
def test_config_file_that_is_no_yaml_text(make, message, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    make(path)
    rc, _, err = train(capsys, ["--config", str(path)])
    assert rc == 2
    assert only_line(err) == f"train.py: error: config file '{path}' {message}"


@pytest.mark.skipif(not os.path.isfile("/proc/self/mem"), reason="needs Linux /proc")
def test_config_file_that_cannot_be_read(capsys):
    # /proc/self/mem is a regular file whose read at offset 0 fails, for root as well.
    rc, _, err = train(capsys, ["--config", "/proc/self/mem"])
    assert rc == 2
    assert only_line(err) == ("train.py: error: config file '/proc/self/mem' cannot be read: "
                              "Input/output error")


@pytest.mark.skipif(ROOT_USER, reason="root reads files whatever their mode")
def test_config_file_without_read_permission(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("steps: 3\n")
    path.chmod(0)
    rc, _, err = train(capsys, ["--config", str(path)])
    assert rc == 2 and "cannot be read: Permission denied" in only_line(err)


def _read_only_folder():
    """A folder where this user cannot create a file: /sys and /proc refuse even root."""
    for folder in ("/sys", "/proc"):
        if os.path.isdir(folder) and write_problem(folder):
            return folder
    return None


@pytest.mark.parametrize("where, message", [
    ("file", "train.py: error: run_dir: '{run}' is a file, not a folder"),
    ("under_file", "train.py: error: run_dir: '{base}' is a file, so '{run}' cannot be a folder"),
    ("checkpoints_file", "train.py: error: checkpoint.dir: '{run}/checkpoints' is a file, not a folder"),
])
def test_run_folder_that_cannot_be_a_folder(where, message, tmp_path, token_cache, capsys):
    base = tmp_path / "taken"
    run = base / "run" if where == "under_file" else base
    if where == "checkpoints_file":
        base.mkdir()
        (base / "checkpoints").write_text("")
    else:
        base.write_text("not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, _, err = train(capsys, tiny(run, token_cache))
    assert rc == 2
    assert only_line(err) == message.format(run=run, base=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(_read_only_folder() is None, reason="no folder this user cannot write")
def test_run_folder_in_a_read_only_folder(token_cache, capsys):
    folder = _read_only_folder()
    run = os.path.join(folder, "lp_jax_run")
    rc, _, err = train(capsys, tiny(run, token_cache))
    assert rc == 2
    line = only_line(err)
    assert line.startswith(f"train.py: error: run_dir: cannot write in '{folder}' (")
    assert not os.path.exists(run)


@pytest.mark.skipif(ROOT_USER, reason="root writes in folders whatever their mode")
def test_run_folder_without_write_permission(tmp_path, token_cache, capsys):
    tmp_path.chmod(0o555)
    try:
        rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache))
    finally:
        tmp_path.chmod(0o755)
    assert rc == 2 and "cannot write in" in only_line(err) and "Permission denied" in err


def test_write_probe_leaves_nothing_behind(tmp_path):
    assert write_problem(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []  # not even the folders it was asked about
