"""The precision study: variants, curve and throughput arithmetic, and one end-to-end
study on a 1-layer Llama (train, stop, resume, reuse, a crashed run, the report)."""
import json
import math
import os
import statistics
import sysconfig

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.errors import UserError
from lp_jax.study import curves, throughput
from lp_jax.study.cli import main
from lp_jax.study.study import StudyOptions, run_study
from lp_jax.study.variants import ablation_variants, parse_precisions, variant_config


def test_precisions_parse_with_policies_and_reject_bad_lists():
    variants = parse_precisions("bf16, fp8_cs,nvfp4:F0L1")
    assert [v.name for v in variants] == ["bf16", "fp8_cs", "nvfp4_f0l1"]
    assert variants[2].precision == {"first_bf16_layers": 0, "last_bf16_layers": 1}
    block = parse_precisions("bf16,fp8_block")[1]
    assert (block.name, block.recipe, block.label) == ("fp8_block", "fp8_block", "FP8 block")
    four, four_f0l1 = parse_precisions("bf16,nvfp4:4over6,nvfp4:4over6:F0L1")[1:]
    assert (four.name, four.label) == ("nvfp4_4over6", "NVFP4 4/6")
    assert four.precision == {"block_scale_search": "4over6"}
    assert (four_f0l1.name, four_f0l1.label) == ("nvfp4_4over6_f0l1", "NVFP4 4/6 F0L1")
    assert four_f0l1.precision == {"first_bf16_layers": 0, "last_bf16_layers": 1,
                                   "block_scale_search": "4over6"}
    for bad, match in (("bf16,fp4", "unknown precision 'fp4'"), ("fp8_cs,mxfp8", "must include bf16"),
                       ("bf16,nvfp4:X1", "bad layer policy"), ("bf16,bf16", "listed twice")):
        with pytest.raises(UserError, match=match):
            parse_precisions(bad)


def test_ablations_switch_one_thing_off_the_studys_nvfp4():
    ablations = ablation_variants(parse_precisions("bf16,nvfp4:F0L1"))
    by_name = {v.name: v.precision for v in ablations}
    assert by_name == {
        "nvfp4_f0l0": {"first_bf16_layers": 0, "last_bf16_layers": 0},
        "nvfp4_no_rht": {"first_bf16_layers": 0, "last_bf16_layers": 1, "disable_rht": True},
        "nvfp4_no_sr": {"first_bf16_layers": 0, "last_bf16_layers": 1,
                        "disable_stochastic_rounding": True},
        "nvfp4_no_2d": {"first_bf16_layers": 0, "last_bf16_layers": 1, "disable_2d": True}}
    # Already all-NVFP4: no duplicate F0L0 row.
    assert "nvfp4_f0l0" not in {v.name for v in ablation_variants(parse_precisions("bf16,nvfp4:F0L0"))}


def test_variant_config_resets_the_precision_and_keeps_everything_else():
    base = load_config(None, ["precision=nvfp4", "precision.last_bf16_layers=1", "steps=7",
                              "checkpoint.dir=/elsewhere"])
    [bf16, mx] = parse_precisions("bf16,mxfp8")
    config = variant_config(base, mx, "out/mxfp8")
    assert config.precision.recipe == "mxfp8" and config.precision.last_bf16_layers is None
    assert config.steps == 7 and config.run_dir == "out/mxfp8" and config.checkpoint.dir is None
    with pytest.raises(UserError, match="precision_schedule"):
        variant_config(load_config(None, ["precision_schedule=[{from_step: 2, recipe: bf16}]"]),
                       bf16, "x")


def test_smoothing_gaps_and_summary_survive_nonfinite_steps():
    values = np.array([4.0, np.nan, 2.0, 2.0])
    np.testing.assert_allclose(curves.smooth(values, 2), [4.0, 4.0, 2.0, 2.0])
    steps, g = curves.relative_gap(np.array([1, 2, 3]), np.array([1.1, 2.2, 3.3]),
                                   np.array([2, 3, 4]), np.array([2.0, 3.0, 4.0]))
    assert list(steps) == [2, 3] and np.allclose(g, [0.1, 0.1])
    metrics = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": "nan", "val_loss": 4.5},
               {"step": 3, "loss": 3.0, "val_loss": 4.0}]
    s = curves.summarize(metrics, 3)
    assert s["final_val_loss"] == 4.0 and s["final_val_step"] == 3 and s["final_train_loss"] == 3.0
    assert curves.gap(4.4, 4.0) == pytest.approx(0.1) and curves.gap(None, 4.0) is None


def test_throughput_leaves_out_compiles_and_weights_by_time():
    rows = [{"step": 1, "step_time_s": 30.0, "tokens_per_sec": 10.0, "tflops_per_device": 0.01}]
    rows += [{"step": s, "step_time_s": t, "tokens_per_sec": 100 / t, "tflops_per_device": 1 / t}
             for s, t in ((2, 1.0), (3, 2.0), (4, 1.0), (5, 60.0))]  # step 5: a resume's compile
    t = throughput.throughput(rows)
    assert t["steps_timed"] == 3 and t["compile_steps_dropped"] == 2
    assert t["tokens_per_sec"] == pytest.approx(300 / 4.0)  # 100 tokens per step over 4 s
    assert t["tflops_per_device"] == pytest.approx(3 / 4.0)
    assert throughput.speedup(t, {"tokens_per_sec": 37.5}) == pytest.approx(2.0)


def test_cli_rejects_bad_input_with_one_line(capsys, tmp_path):
    common = ["--config", "configs/tiny.yaml", "--tasks", "none", "--out", str(tmp_path / "x")]
    assert main([*common, "--precisions", "bf16,fp9"]) == 2
    assert main([*common, "optimizer.lerning_rate=1"]) == 2
    # NVFP4's default F0L4 on the 4-layer tiny model would quantize nothing: refused up front.
    assert main([*common, "--precisions", "bf16,nvfp4"]) == 2
    assert main([*common, "--precisions", "bf16,fp8_cs:F2L3"]) == 2  # the trainer's own check
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("python -m lp_jax.study: error:") for line in err)
    assert "fp9" in err[0] and "lerning_rate" in err[1]
    assert "precision nvfp4: layer policy F0L4 keeps all 4 layers in BF16" in err[2]
    assert "precision fp8_cs_f2l3" in err[3]
    assert not (tmp_path / "x").exists()  # nothing was trained or written


TEXT = [os.path.join(sysconfig.get_paths()["stdlib"], p) for p in ("json/*.py", "email/*.py")]


def _options(out, cache, *extra, precisions="bf16,fp8_cs:F0L0", xla=False, tasks=()):
    overrides = ("steps=8", "model.num_layers=1", f"data.paths={TEXT}", "data.val_fraction=0.2",
                 f"data.cache_dir={cache}", "data.seq_len=32", "data.global_batch_size=2",
                 "data.micro_batch_size=2", "schedule.warmup_steps=2", "checkpoint.every=4",
                 "logging.val_every=4", "logging.val_batches=1", "logging.tensorboard=false",
                 *extra)
    return StudyOptions("configs/tiny.yaml", overrides, precisions=precisions, out=str(out),
                        tasks=tasks, limit=2, xla_memory=xla, progress_every=0.5)


def _eval_tasks():
    try:
        from lp_jax.evaluation.data_package import package_dir
        package_dir()
    except Exception:  # noqa: BLE001 - the benchmark package is optional for this test
        return ()
    return ("arc_easy",)


@pytest.mark.slow
def test_study_trains_resumes_reuses_and_reports_a_crashed_run(tmp_path, token_cache):
    out, said = tmp_path / "study", []
    # 1. Interrupted on purpose at step 4 (stop_at changes nothing else).
    first = run_study(_options(out, token_cache, "stop_at=4"), said.append)
    assert {r["status"] for r in first["runs"].values()} == {"trained"}
    assert all(r["last_step"] == 4 for r in first["runs"].values())
    assert any("[bf16] training to step 4" in line for line in said)
    # 2. The same study without stop_at resumes each run from its checkpoint to step 8.
    said.clear()
    tasks = _eval_tasks()
    second = run_study(_options(out, token_cache, xla=True, tasks=tasks), said.append)
    assert any("[fp8_cs_f0l0] resuming from step 4" in line for line in said)
    runs = second["runs"]
    for name, run in runs.items():
        metrics = [json.loads(l) for l in open(out / "runs" / name / "metrics.jsonl")]
        assert [m["step"] for m in metrics] == list(range(1, 9))  # each step once
        assert run["status"] == "trained" and run["last_step"] == 8
        assert run["final_val_loss"] == metrics[-1]["val_loss"]
        assert run["val_curve"] == [[4, metrics[3]["val_loss"]], [8, metrics[7]["val_loss"]]]
        t = run["throughput"]
        times = [m["step_time_s"] for m in metrics if m["step"] != 1]
        kept = [m for m in metrics if m["step"] != 1 and m["step_time_s"] <= 5 * statistics.median(times)]
        assert t["steps_timed"] == len(kept) and t["compile_steps_dropped"] == 8 - len(kept) >= 2
        assert t["tokens_per_sec"] == pytest.approx(2 * 32 * len(kept) / sum(m["step_time_s"] for m in kept))
        mem = run["memory_bytes"]
        assert mem["master_weights"] == mem["gradients"] and mem["optimizer_moments"] > mem["master_weights"]
        assert 0 < mem["linear_inputs"] < mem["activations"] and mem["xla_temp"] > 0
        if tasks:
            assert run["eval"]["results"]["arc_easy"]["n"] == 2
    bf16, fp8 = runs["bf16"], runs["fp8_cs_f0l0"]
    assert fp8["val_gap_to_bf16"] == pytest.approx(
        (fp8["final_val_loss"] - bf16["final_val_loss"]) / bf16["final_val_loss"])
    assert fp8["final_val_loss"] != bf16["final_val_loss"]  # FP8 really trained differently
    # Second half of 8 steps: only the validation at step 8.
    assert fp8["late_val_gap_to_bf16"] == pytest.approx(fp8["val_gap_to_bf16"])
    # FP8 keeps 1-byte linear inputs where BF16 keeps 2; everything else is the same.
    assert fp8["memory_bytes"]["linear_inputs"] < bf16["memory_bytes"]["linear_inputs"]
    assert fp8["memory_bytes"]["optimizer_moments"] == bf16["memory_bytes"]["optimizer_moments"]
    assert fp8["memory_bytes"]["quantized_linears"] == fp8["memory_bytes"]["linears"] == 7
    assert bf16["memory_bytes"]["quantized_linears"] == 0
    report = (out / "report.md").read_text()
    assert "![Loss by training precision](loss_precisions.png)" in report
    assert f"| FP8-CS F0L0 | {fp8['throughput']['tokens_per_sec']:,.0f} |" in report
    assert f"{fp8['final_val_loss']:.4f} | {100 * fp8['val_gap_to_bf16']:+.2f}%" in report
    assert (out / "loss_precisions.png").stat().st_size > 10_000
    text = (out / "study.json").read_text()
    assert json.loads(text)["runs"]["bf16"]["final_val_loss"] == bf16["final_val_loss"]
    assert f'[8,{json.dumps(bf16["final_val_loss"])}]' in text  # curve points one per line
    # 3. Again, with a third precision whose run crashes (a NaN at step 6 with
    # on_nonfinite=stop, for that run only): the finished runs are reused untouched, the
    # crash is reported, the rest of the report stays.
    stamp = (out / "runs" / "bf16" / "metrics.jsonl").stat().st_mtime_ns
    said.clear()
    third = run_study(_options(out, token_cache, "mxfp8_f0l0:debug.inject_nan_at_steps=[6]",
                               "mxfp8_f0l0:optimizer.on_nonfinite=stop",
                               precisions="bf16,fp8_cs:F0L0,mxfp8:F0L0"), said.append)
    assert (out / "runs" / "bf16" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert any("[bf16] reusing the finished run" in line for line in said)
    assert third["runs"]["bf16"]["status"] == third["runs"]["fp8_cs_f0l0"]["status"] == "complete"
    crashed = third["runs"]["mxfp8_f0l0"]
    assert crashed["status"] == "failed" and "exit status 1" in crashed["message"]
    assert crashed["last_step"] == 5 and crashed["final_val_step"] == 4
    assert crashed["val_gap_to_bf16"] is None  # not compared with runs that reached step 8
    report = (out / "report.md").read_text()
    assert "## Problems" in report and "**MXFP8 F0L0**: training failed (exit status 1)" in report
    assert "step 6: loss nan" in crashed["message"]
    assert f"| BF16 | - | 0/7 | reused, step 8/8 | {bf16['final_val_loss']:.4f} |" in report
    assert math.isfinite(third["runs"]["fp8_cs_f0l0"]["final_val_loss"])


def _finished_run(run_dir, steps, eval_step=None):
    """A run folder as the trainer leaves it at `steps` (metrics and a checkpoint folder),
    with, if eval_step is given, the evaluation cache an older study wrote: the checkpoint
    named by its absolute path, as `LoadedModel.source` gives it."""
    (run_dir / "checkpoints" / str(steps)).mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            line = {"step": step, "loss": 3.0 - 0.1 * step, "step_time_s": 0.5,
                    "tokens_per_sec": 128.0, "tflops_per_device": 0.001}
            if step % 2 == 0:
                line["val_loss"] = 3.1 - 0.1 * step
            f.write(json.dumps(line) + "\n")
    if eval_step is not None:
        (run_dir / "study_eval.json").write_text(json.dumps({
            "step": eval_step, "settings": {"tasks": ["arc_easy"], "limit": 2, "shots": 0},
            "model": f"checkpoint:{run_dir.resolve()}@{eval_step}",
            "results": {"arc_easy": {"acc": 0.5, "acc_stderr": 0.5, "acc_norm": 0.5,
                                     "acc_norm_stderr": 0.5, "n": 2}}}))


@pytest.mark.parametrize("runs_dir", [None, "elsewhere/runs"])
def test_report_names_run_folders_relative_to_itself(tmp_path, monkeypatch, runs_dir):
    """study.json records run folders and evaluated checkpoints relative to the report
    folder (a committed report names no machine's folders), and a path it records leads,
    from the report folder, to the folder the --no-train study read."""
    from lp_jax.study import memory
    from lp_jax.study.report import resolve_report_path

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "tiny.yaml")
    monkeypatch.chdir(tmp_path)  # relative --out and --runs-dir, as on a command line
    monkeypatch.setattr(memory, "memory_table_row", lambda *a, **k: None)  # not about memory
    run_dir = tmp_path / (runs_dir or "study/runs") / "bf16"
    _finished_run(run_dir, 4, eval_step=4)
    said = []
    summary = run_study(StudyOptions(config, ("steps=4",), precisions="bf16", out="study",
                                     runs_dir=runs_dir, tasks=("arc_easy",), limit=2,
                                     xla_memory=False, train=False), said.append)
    run = summary["runs"]["bf16"]
    assert run["status"] == "complete" and run["last_step"] == 4  # read, not trained
    expected = "runs/bf16" if runs_dir is None else "../elsewhere/runs/bf16"
    assert run["run_dir"] == expected
    assert run["eval"]["model"] == f"checkpoint:{expected}@4"  # not the cache's absolute path
    assert run["eval"]["results"]["arc_easy"]["n"] == 2  # the cached scores were reused
    recorded = resolve_report_path(tmp_path / "study", run["run_dir"])
    assert recorded.resolve() == run_dir.resolve()
    assert (recorded / "checkpoints" / "4").is_dir()
    for name in ("study.json", "report.md"):
        assert str(tmp_path) not in (tmp_path / "study" / name).read_text()
    assert json.loads((tmp_path / "study" / "study.json").read_text())["runs"] == summary["runs"]


@pytest.mark.parametrize("code", [75, 1])
def test_a_run_stopped_by_a_signal_interrupts_the_study_and_a_crash_does_not(tmp_path, monkeypatch,
                                                                             code):
    """A child that exits checkpoint.preempted_exit_code saved after a signal (a scheduler's
    SIGTERM reached it): the study stops as on its own SIGTERM; any other status is that
    run's failure. A stand-in train.py exits with the status."""
    from lp_jax.study import runs

    (tmp_path / "train.py").write_text(f"import sys\nsys.exit({code})\n")
    monkeypatch.setattr(runs, "REPO_ROOT", tmp_path)
    config = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    if code == 75:
        with pytest.raises(runs.StudyInterrupted, match=r"\[bf16\] stopped by a signal after "
                                                        r"saving \(exit status 75\)"):
            runs.train(config, "bf16", say=lambda line: None, progress_every=0.1)
    else:
        status = runs.train(config, "bf16", say=lambda line: None, progress_every=0.1)
        assert status.state == "failed" and "exit status 1" in status.message
