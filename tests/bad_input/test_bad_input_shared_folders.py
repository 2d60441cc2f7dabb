"""Folders a run shares with another, and links inside its run folder (docs/bad_input.md,
case 22): a checkpoint folder in use by another job, a run folder holding another run's
files, `train.lock` or `config.yaml` as symbolic links, a run_dir through a link. Each is
refused in one line before anything is written, or resolved the one way every reader
resolves it."""
import json
import os
import socket

import pytest

from lp_jax.errors import UserError
from lp_jax.runs.run_folder import open_run
from lp_jax.runs.run_lock import LOCK_NAME, FolderLocks, RunLock
from lp_jax.training.metrics import read_metrics
from tests.support.bad_input import only_line, tiny, train


@pytest.mark.parametrize("layout", ["checkpoint.dir shared", "run_dir is the other's checkpoint.dir"])
def test_a_checkpoint_folder_in_use_by_another_job_is_refused(layout, tmp_path, token_cache, capsys):
    """Before, both jobs ran with exit 0 and the folder ended with one job's checkpoints."""
    first_run, shared = tmp_path / "first", tmp_path / "shared"
    second_run, overrides = tmp_path / "second", [f"checkpoint.dir={shared}"]
    if layout != "checkpoint.dir shared":
        shared = tmp_path / "second" / "checkpoints"
        overrides = []
    for folder in (first_run, shared):
        folder.mkdir(parents=True)
    holder = FolderLocks([("run_dir", first_run), ("checkpoint.dir", shared)], lambda line: None,
                         first_run)  # this process, another open file: a live job
    try:
        rc, _, err = train(capsys, tiny(second_run, token_cache, *overrides))
    finally:
        holder.release()
    assert rc == 2
    line = only_line(err)
    assert line.startswith(f"train.py: error: checkpoint.dir {str(shared)!r} is in use by process "
                           f"{os.getpid()} on {socket.gethostname()} (since "), line
    assert line.endswith(f", run_dir {str(first_run)!r} (lock {shared / LOCK_NAME}): one "
                         "checkpoint folder takes one job; wait for it to end, or use another "
                         "checkpoint.dir"), line
    assert not (second_run / "config.yaml").exists() and not (second_run / "metrics.jsonl").exists()
    assert sorted(os.listdir(shared)) == []
    assert not (second_run / LOCK_NAME).exists()  # the run folder's lock was given back


def test_a_fresh_run_never_overwrites_another_runs_metrics(tmp_path, token_cache, capsys):
    """A run folder whose run kept its checkpoints elsewhere (checkpoint.dir): a run
    started there without that key found no checkpoint, started afresh, and cut the 40
    rows of metrics.jsonl to its own 3."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    config = f"checkpoint:\n  dir: {elsewhere}\n"
    (run_dir / "config.yaml").write_text(config)
    rows = "".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(1, 41))
    (run_dir / "metrics.jsonl").write_text(rows)
    rc, _, err = train(capsys, tiny(run_dir, token_cache))
    assert rc == 2
    assert only_line(err) == (
        f"train.py: error: run_dir {str(run_dir)!r} holds another run's config.yaml and "
        f"metrics.jsonl (40 rows), whose checkpoints are in {str(elsewhere)!r}, and checkpoint.dir "
        f"{str(run_dir / 'checkpoints')!r} holds no checkpoint: a fresh run would overwrite them; "
        "resume that run with its checkpoint.dir, or use another run_dir")
    assert (run_dir / "metrics.jsonl").read_text() == rows
    assert (run_dir / "config.yaml").read_text() == config


@pytest.mark.parametrize("name", [LOCK_NAME, "config.yaml", "metrics.jsonl"])
def test_a_link_in_the_run_folder_is_never_written_through(name, tmp_path, token_cache, capsys):
    """Before, the lock record or the run's config was written over the link's target."""
    run_dir, target = tmp_path / "run", tmp_path / "precious.txt"
    run_dir.mkdir()
    target.write_text("precious\n")
    (run_dir / name).symlink_to(target)
    rc, _, err = train(capsys, tiny(run_dir, token_cache))
    assert rc == 2
    assert only_line(err) == (f"train.py: error: run_dir: {run_dir / name} is a symbolic link (to "
                              f"{str(target)!r}); a run never writes through a link: remove it, "
                              "or replace it with a copy")
    assert target.read_text() == "precious\n"
    assert not (run_dir / "checkpoints").exists()


def test_the_lock_itself_never_opens_a_link(tmp_path):
    """The lock's own guard, behind the config check: O_NOFOLLOW, one line."""
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(UserError, match=r"^checkpoint\.dir: .*train\.lock is a symbolic link \(to "):
        RunLock(tmp_path, key="checkpoint.dir")
    assert target.read_text() == "precious\n"


@pytest.mark.slow  # a training run
def test_a_run_dir_through_a_link_and_dot_dot_is_one_folder(tmp_path, token_cache, capsys):
    """run_dir=base/L/../r with L a link to base/real/deep: the kernel takes L, then `..`,
    so the run folder is base/real/r. Before, config and metrics went there and the
    checkpoints to the textually normalised base/r, and export and eval found none."""
    deep = tmp_path / "real" / "deep"
    deep.mkdir(parents=True)
    (tmp_path / "L").symlink_to(deep)
    run_dir = f"{tmp_path}/L/../r"
    rc, _, err = train(capsys, tiny(run_dir, token_cache, "stop_at=2"))
    assert rc == 0, err
    real = tmp_path / "real" / "r"
    assert sorted(os.listdir(real)) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert sorted(os.listdir(real / "checkpoints")) == ["2"]
    assert not (tmp_path / "r").exists()
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2]
    saved = open_run(run_dir)  # what `python -m lp_jax.export` and `eval.py --checkpoint` read
    assert (saved.step, saved.checkpoint_dir) == (2, str(real / "checkpoints"))


def test_the_lost_lock_names_its_folder(tmp_path):
    """The lock whose file went tells the trainer which folder was lost: its config key
    picks the run folder's message or the checkpoint folder's."""
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "elsewhere" / "ckpt"
    run_dir.mkdir()
    locks = FolderLocks([("run_dir", run_dir), ("checkpoint.dir", ckpt_dir)], run_dir=run_dir)
    try:
        assert locks.lost() is None
        (ckpt_dir / LOCK_NAME).unlink()
        lost = locks.lost()
        assert lost.key == "checkpoint.dir" and lost.path == str(ckpt_dir / LOCK_NAME)
    finally:
        locks.release()
