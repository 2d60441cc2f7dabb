"""The tools that read a run's weights (eval.py --checkpoint, `python -m lp_jax.export`,
init.checkpoint, `python -m lp_jax.inspect`) over a damaged latest checkpoint
(docs/bad_input.md, case 5): they read the newest checkpoint that restores, say which one
they skipped and why on stderr, and leave the folder as it is (only the trainer sets
damaged checkpoints aside). A step named explicitly is read or refused, never replaced."""
import json
import subprocess
import sys

import pytest

from lp_jax.errors import UserError
from lp_jax.evaluation.loading import load_from_run_dir
from lp_jax.runs.run_folder import open_and_restore
from tests.bad_input.test_bad_input_resume import DAMAGE
from tests.support.bad_input import ROOT, array_files, run, stopped_run, truncate  # noqa: F401 (fixtures)


def _truncate_every_array_file(step):
    """The trainer's "truncated array file" halves the largest, which may hold only optimizer
    moments, which these readers never read: here every array file is halved."""
    for path in array_files(step):
        truncate(path)


# The trainer's damages (a missing data item harms no weights), array files all truncated.
READER_DAMAGE = {**{k: v for k, v in DAMAGE.items() if k != "missing data item"},
                 "truncated array file": _truncate_every_array_file}


def _listing(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _warning(err, run):
    lines = [line for line in err.splitlines() if line.startswith("warning: checkpoint 4")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"warning: checkpoint 4 in {run / 'checkpoints'} cannot be restored (")
    assert lines[0].endswith("); skipped (left as it is), using step 2")
    return lines[0]


@pytest.mark.parametrize("damage", list(READER_DAMAGE))
def test_eval_and_export_read_the_newest_checkpoint_that_restores(damage, run, capsys):
    READER_DAMAGE[damage](run / "checkpoints" / "4")
    loaded = load_from_run_dir(str(run))  # the one run-folder reader: meta is read too
    assert loaded.source == f"checkpoint:{run}@2"
    _warning(capsys.readouterr().err, run)
    saved, model = open_and_restore(str(run))
    assert saved.step == 2 and model is not None
    _warning(capsys.readouterr().err, run)
    assert _listing(run) == ["2", "4"]  # nothing renamed, nothing written


def test_export_from_the_command_line(run, tmp_path):
    """The real command, in its own process: there Orbax's abandoned array reads would print
    their tracebacks to stderr (under pytest they become warnings), so stderr is checked whole."""
    _truncate_every_array_file(run / "checkpoints" / "4")
    export = [sys.executable, "-m", "lp_jax.export", str(run)]
    proc = subprocess.run([*export, str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported" in proc.stdout and "step 2 ->" in proc.stdout
    assert proc.stderr == _warning(proc.stderr, run) + "\n"  # one line, no traceback
    assert "TensorStore details" not in proc.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == 128
    # Step 4 asked for by name: refused in one line, not replaced by step 2.
    proc = subprocess.run([*export, str(tmp_path / "hf4"), "--step", "4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and "step 4: no readable item 'state'" in proc.stderr
    assert _listing(run) == ["2", "4"]


def test_no_checkpoint_restores_is_one_error_naming_each(run):
    for step in ("2", "4"):
        DAMAGE["garbled array metadata"](run / "checkpoints" / step)
    with pytest.raises(UserError) as e:
        load_from_run_dir(str(run))
    assert str(e.value).startswith(f"{run / 'checkpoints'}: no checkpoint restores: step 4: ")
    assert "; step 2: " in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="no checkpoint restores: step 4: .*; step 2: "):
        open_and_restore(str(run))
    assert _listing(run) == ["2", "4"]


def test_a_reader_racing_the_trainers_rotation_reads_the_step_saved_meanwhile(run, capsys, monkeypatch):
    """checkpoint.keep deletes the steps a reader listed while it reads them: those are
    passed over without a warning, and the folder is listed again rather than reporting
    that no checkpoint restores (docs/bad_input.md, case 5)."""
    import shutil

    from lp_jax.runs import run_folder

    checkpoints, real_open_run, opened = run / "checkpoints", run_folder.open_run, []

    def rotating_open_run(path, step=None):
        if not opened:  # the trainer saves step 6 and, keeping 1, deletes 2 and 4
            shutil.copytree(checkpoints / "4", checkpoints / "6")
            shutil.rmtree(checkpoints / "4")
            shutil.rmtree(checkpoints / "2")
        opened.append(step)
        return real_open_run(path, step)

    monkeypatch.setattr(run_folder, "open_run", rotating_open_run)
    saved, model = open_and_restore(str(run))
    assert (saved.step, opened) == (6, [4, 2, 6]) and model is not None
    assert "warning" not in capsys.readouterr().err
