"""python -m lp_jax.inspect on a real (two-step, two-layer) training run: the table, the
sensitivity, the override, inspect.md and the heatmap; one-line errors for bad input on a real run (the others: test_bad_input_inspect.py)."""
import pytest

from lp_jax.inspect.cli import main
from lp_jax.training.loop import run
from lp_jax.training.validate import resolve
from tests.bad_input.test_bad_input_inspect import _error
from tests.training.test_training_loop import tiny


@pytest.mark.slow
def test_inspect_a_run(tmp_path, token_cache, capsys):
    run_dir = tmp_path / "run"
    run(resolve(tiny(run_dir, token_cache, "steps=2", "model.num_layers=2", "precision=fp8_cs",
                     "precision.first_bf16_layers=0", "logging.val_batches=0")))
    assert "unknown recipe 'fp9'" in _error(capsys, [str(run_dir), "--recipe", "fp9"])
    assert "quantizes nothing" in _error(capsys, [str(run_dir), "--recipe", "bf16"])
    assert _error(capsys, [str(run_dir), "--hf", str(tmp_path / "nope")]) == f"--hf {tmp_path / 'nope'}: no such folder"
    assert not (run_dir / "inspect.md").exists()
    assert main([str(run_dir), "--batches", "1", "--budget", "50"]) == 0
    out = capsys.readouterr().out
    assert "recipe fp8_cs on every layer; 1 batch(es)" in out
    assert "| 1 | mlp/up_proj | wgrad_dy |" in out  # every layer measured, the run's BF16 one too
    assert "| only layer 1 |" in out and "| all |" in out
    assert "Config override: precision.first_bf16_layers=0 precision.last_bf16_layers=0" in out
    md = (run_dir / "inspect.md").read_text()
    assert "## Sensitivity" in md and "![SQNR heatmap](inspect_sqnr.png)" in md
    assert (run_dir / "inspect_sqnr.png").read_bytes()[:4] == b"\x89PNG"
