"""Model FLOPs, device peaks, metrics.jsonl and TensorBoard."""
import os
import types

import pytest

from lp_jax.training import metrics


def llama3_8b():
    return types.SimpleNamespace(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                                 intermediate_size=14336, num_layers=32, vocab_size=128256)


def test_model_flops_formula():
    cfg = llama3_8b()
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    n = 32 * per_layer + 4096 * 128256
    assert metrics.matmul_params(cfg) == n
    # 8B total minus the 0.53B embedding table: about 7.5B multiply parameters.
    assert 7.4e9 < n < 7.6e9
    assert metrics.flops_per_token(cfg, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192


@pytest.mark.parametrize("kind, recipe, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 80GB HBM3", "fp8_cs", 1978.9),
    ("NVIDIA H200", "mxfp8", 1978.9),
    ("NVIDIA H200", "nvfp4", 989.4),  # no FP4 tensor cores: NVFP4 runs dequantized in BF16
    ("NVIDIA B200", "bf16_with_nvfp4_mixed", 9000.0),
    ("NVIDIA GB200", "nvfp4", 10000.0),
    ("NVIDIA GB200", "bf16", 2500.0),
    ("NVIDIA H100 PCIe", "bf16", None),
    ("cpu", "bf16", None),
])
def test_peak_table(kind, recipe, peak):
    assert metrics.peak_tflops(kind, recipe) == peak


def test_metrics_file_truncates_on_resume_and_writes_tensorboard(tmp_path):
    w = metrics.MetricsWriter(tmp_path, start_step=0, tensorboard=True)
    for step in range(1, 6):
        w.write(step, {"loss": 1.0 / step, "lr": 0.1})
    w.write(6, {"loss": float("nan"), "lr": 0.1})
    w.close()
    assert [m["step"] for m in metrics.read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert metrics.read_metrics(tmp_path)[-1]["loss"] == "nan"  # strict JSON has no NaN
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    # Resumed from step 3: steps 4-6 of the interrupted run are gone, then rewritten.
    w = metrics.MetricsWriter(tmp_path, start_step=3, tensorboard=False)
    w.write(4, {"loss": 0.5, "val_loss": 0.6})
    w.close()
    assert [(m["step"], m.get("val_loss")) for m in metrics.read_metrics(tmp_path)] == [
        (1, None), (2, None), (3, None), (4, 0.6)]


def test_a_line_cut_short_by_a_kill_is_dropped_on_read_and_on_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [m["step"] for m in metrics.read_metrics(tmp_path)] == [1, 2]
    w = metrics.MetricsWriter(tmp_path, start_step=2, tensorboard=False)
    w.write(3, {"loss": 1.2})
    w.close()
    assert [(m["step"], m["loss"]) for m in metrics.read_metrics(tmp_path)] == [(1, 2.0), (2, 1.5), (3, 1.2)]
    assert metrics.read_metrics(tmp_path / "absent") == []


def test_a_damaged_line_in_the_middle_costs_only_itself_on_read_and_on_resume(tmp_path, capsys):
    rows = ['{"step": 1, "loss": 2.0}', '{"step": 2, "lo\x00ss"', '[3]', '{"step": 3, "loss": 1.2}',
            '{"step": 4, "loss": 1.1}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert [m["step"] for m in metrics.read_metrics(tmp_path)] == [1, 3, 4]
    w = metrics.MetricsWriter(tmp_path, start_step=3, tensorboard=False)
    w.write(4, {"loss": 1.0})
    w.close()
    assert [(m["step"], m["loss"]) for m in metrics.read_metrics(tmp_path)] == [(1, 2.0), (3, 1.2), (4, 1.0)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 2 damaged line(s)" in err[0] and "metrics.jsonl" in err[0]
