"""python -m lp_jax.inspect on a real (two-step, two-layer) training run: the table, the
sensitivity, the override, inspect.md and the heatmap; one-line errors for bad input."""
import pytest

from lp_jax.inspect.cli import main
from lp_jax.training.loop import run
from lp_jax.training.validate import resolve
from tests.test_training_loop import tiny


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m lp_jax.inspect: error: ")
    return lines[0]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert "no such folder" in _error(capsys, [str(tmp_path / "nope")])
    (tmp_path / "config.yaml").write_text("model: {preset: tiny}\n")
    assert "no checkpoints" in _error(capsys, [str(tmp_path)])
    assert "--batches 0: must be at least 1" in _error(capsys, [str(tmp_path), "--batches", "0"])


@pytest.mark.slow
def test_inspect_a_run(tmp_path, token_cache, capsys):
    run_dir = tmp_path / "run"
    run(resolve(tiny(run_dir, token_cache, "steps=2", "model.num_layers=2", "precision=fp8_cs",
                     "precision.first_bf16_layers=0", "logging.val_batches=0")))
    assert "unknown recipe 'fp9'" in _error(capsys, [str(run_dir), "--recipe", "fp9"])
    assert "quantizes nothing" in _error(capsys, [str(run_dir), "--recipe", "bf16"])
    assert main([str(run_dir), "--batches", "1", "--budget", "50"]) == 0
    out = capsys.readouterr().out
    assert "recipe fp8_cs on every layer; 1 batch(es)" in out
    assert "| 1 | mlp/up_proj | wgrad_dy |" in out  # every layer measured, the run's BF16 one too
    assert "| only layer 1 |" in out and "| all |" in out
    assert "Config override: precision.first_bf16_layers=0 precision.last_bf16_layers=0" in out
    md = (run_dir / "inspect.md").read_text()
    assert "## Sensitivity" in md and "![SQNR heatmap](inspect_sqnr.png)" in md
    assert (run_dir / "inspect_sqnr.png").read_bytes()[:4] == b"\x89PNG"
