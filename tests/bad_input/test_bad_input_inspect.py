"""python -m lp_jax.inspect on bad input: one line on stderr starting with the program's
name, exit 2, nothing written (docs/bad_input.md)."""
from lp_jax.inspect.cli import main
from tests.support.bad_input import only_line

PREFIX = "python -m lp_jax.inspect: error: "


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    return only_line(capsys.readouterr().err, PREFIX)[len(PREFIX):]


def test_inspect_of_a_missing_folder(tmp_path, capsys):
    assert _error(capsys, [str(tmp_path / "nope")]) == f"{tmp_path / 'nope'}: no such folder"
    assert not (tmp_path / "nope").exists()


def test_inspect_of_a_run_without_checkpoints(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model: {preset: tiny}\n")
    assert "no checkpoints" in _error(capsys, [str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_inspect_with_a_bad_batch_count_or_budget(tmp_path, capsys):
    assert _error(capsys, [str(tmp_path), "--batches", "0"]) == "--batches 0: must be at least 1"
    assert _error(capsys, [str(tmp_path), "--budget", "-1"]) == "--budget -1.0: must be >= 0 (percent)"
    assert list(tmp_path.iterdir()) == []
