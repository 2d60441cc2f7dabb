"""Renamed names keep working for the code and job scripts that use them, with one line
saying what replaced them."""
import difflib
import importlib
import pathlib
import pkgutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_validated_run_answers_to_its_old_name_with_a_warning():
    from lp_jax.training import validate

    with pytest.warns(DeprecationWarning, match="validate.Plan is deprecated; use ValidatedRun"):
        from lp_jax.training.validate import Plan
    assert Plan is validate.ValidatedRun
    with pytest.raises(AttributeError):
        validate.NoSuchName  # noqa: B018


def test_the_lazy_import_helper_is_not_one_letter_from_the_export_command():
    import lp_jax

    names = [m.name for m in pkgutil.iter_modules(lp_jax.__path__)]
    assert "export" in names  # python -m lp_jax.export
    near = [n for n in names if n != "export" and difflib.SequenceMatcher(None, n, "export").ratio() > 0.8]
    assert not near, f"modules named almost as the export command: {near}"
    assert callable(importlib.import_module("lp_jax.lazy_exports").lazy_exports)


def test_training_prepare_data_runs_the_data_command_and_says_so(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 50)
    args = ["--out", str(tmp_path / "out"), "--val-fraction", "0", str(text)]
    old = subprocess.run([sys.executable, "-m", "lp_jax.training.prepare_data", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    assert old.stderr.splitlines()[0] == ("lp_jax.training.prepare_data is deprecated; "
                                          "run python -m lp_jax.data.prepare_data")
    assert list((tmp_path / "out").iterdir())  # the shards were written
    with pytest.warns(DeprecationWarning, match="run python -m lp_jax.data.prepare_data"):
        from lp_jax.training.prepare_data import main
    from lp_jax.data import prepare_data
    assert main is prepare_data.main
