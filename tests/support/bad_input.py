"""Helpers of the bad-input tests (docs/bad_input.md): train.py run in-process on a tiny
config, the one line it must end with, and a stopped run to damage (fixtures: import
``stopped_run`` and ``run`` into the test module)."""
import os
import pathlib
import shutil
import sysconfig

import pytest

from lp_jax.training import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A stdlib package as text: real code, tokenized in a second.
TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


def tiny(run_dir, cache, *overrides) -> list[str]:
    """train.py's argv for a tiny run: steps=6 everywhere (shorter runs use stop_at), so
    that the runs of one test process share one compiled step."""
    return ["--config", str(ROOT / "configs" / "tiny.yaml"), f"run_dir={run_dir}", "steps=6",
            "data.seq_len=32", "data.global_batch_size=2", "data.micro_batch_size=2",
            f"data.paths=[{TEXT}]", "data.val_fraction=0.3", f"data.cache_dir={cache}",
            "checkpoint.every=2", "checkpoint.keep=5", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.val_batches=1", *overrides]


def train(capsys, argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of train.py with these arguments."""
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str, prefix: str = "train.py: error: ") -> str:
    """The line a failed run ends with: the last of stderr, after no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith(prefix), err
    return lines[-1]


def only_line(err: str, prefix: str = "train.py: error: ") -> str:
    """An error found before the run started: the one line on stderr."""
    assert err.count("\n") == 1, err
    return error_line(err, prefix)


def array_files(step) -> list:
    """The array data files of a checkpoint step's ``state`` item (OCDBT's ``d/`` folders)."""
    return [p for p in (step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def truncate(path) -> None:
    """Cuts a file to half its length."""
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, token_cache):
    """A run stopped at step 4 of 6, with checkpoints 2 and 4 (one per test module)."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    assert cli.main(tiny(run, token_cache, "stop_at=4")) == 0
    return run


@pytest.fixture
def run(stopped_run, tmp_path):
    """A copy of the stopped run, the test's own to damage."""
    copy = tmp_path / "run"
    shutil.copytree(stopped_run, copy)
    return copy
