"""`python -m lp_jax.study --verify RECORDS`: a study's records name the code that trained
them, and retraining their first steps says whether today's code still takes the same
path: a record it reproduces is `same`, one whose loss was altered `differs at step 1`."""
import json
import os
import shutil
import sysconfig

import jax

from lp_jax.study import memory, provenance, verify
from lp_jax.study.cli import main
from lp_jax.study.study import StudyOptions, run_study

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


def _study(out, cache, train=True):
    overrides = ("steps=2", "model.num_layers=1", f"data.paths={TEXT}", "data.val_fraction=0.3",
                 f"data.cache_dir={cache}", "data.seq_len=32", "data.global_batch_size=2",
                 "data.micro_batch_size=2", "schedule.warmup_steps=1", "checkpoint.every=2",
                 "logging.val_every=2", "logging.val_batches=1", "logging.tensorboard=false")
    return StudyOptions(CONFIG, overrides, precisions="bf16", seeds=(0,), twin=False,
                        out=str(out), records=str(out / "records"), tasks=(), xla_memory=False,
                        train=train, progress_every=0.5)


def test_a_recorded_run_verifies_same_and_an_altered_loss_differs_at_step_1(
        tmp_path, token_cache, monkeypatch, capsys):
    monkeypatch.setattr(memory, "memory_table_row", lambda *a, **k: None)  # not about memory
    study = tmp_path / "study"
    summary = run_study(_study(study, token_cache), lambda line: None)
    assert summary["unfinished"] == []
    now = provenance.current()
    assert now["jax"] == jax.__version__
    trained_on = json.loads((study / "records" / "seed0" / "bf16" / "machine.json").read_text())
    assert (trained_on["commit"], trained_on["jax"]) == (now["commit"], now["jax"])
    assert (summary["commit"], summary["jax"]) == (now["commit"], now["jax"])
    assert summary["trained_by"] == [{**now, "runs": 1}]
    assert summary["runs"]["bf16"]["made_by"] == now

    capsys.readouterr()
    assert main(["--verify", str(study), "--steps", "2", "--write"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"seed0/bf16: recorded {provenance.describe(now)}; now "
                                f"{provenance.describe(now)}: same"]
    assert "[seed0/bf16] retraining steps 1-2" in err  # progress and the trainer's lines
    written = verify.read(study / "records")
    assert [c["runs"][0]["same"] for c in written["checks"]] == [True]
    # The report quotes it, and says which code trained the runs (no training: reused).
    run_study(_study(study, token_cache, train=False), lambda line: None)
    report = (study / "report.md").read_text()
    assert f"- Trained by: {provenance.describe(now)} (the run; each run's machine.json)." in report
    assert f"({provenance.describe(now)}) retrained each record's first 2 step(s): all 1 " \
           "reproduce their recorded losses bit for bit." in report

    altered = tmp_path / "altered"
    shutil.copytree(study / "records", altered)
    metrics = altered / "seed0" / "bf16" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    recorded = rows[0]["loss"]
    rows[0]["loss"] = recorded + 1e-6
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--verify", str(altered), "--steps", "2"]) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("seed0/bf16: recorded ")
    assert line.endswith(f": differs at step 1 (recorded {rows[0]['loss']}, now {recorded})")


def test_bad_input_gets_one_line_and_exit_status_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for name in ("seed0/bf16", "seed1/bf16"):  # records, never trained here
        (tmp_path / "records" / name).mkdir(parents=True)
        (tmp_path / "records" / name / "config.yaml").write_text("steps: 2\n")
        (tmp_path / "records" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    records = tmp_path / "records"
    assert [p.name for p in verify.selected(records, "seed1/*, seed7/*")] == ["bf16"]
    assert len(verify.selected(records)) == 2
    for argv in (["--verify", str(tmp_path / "missing")],
                 ["--verify", str(tmp_path / "empty")],
                 ["--verify", str(tmp_path), "--steps", "0"],
                 ["--verify", str(tmp_path), "--config", CONFIG],
                 ["--verify", str(tmp_path), "--only", "seed9/*"],
                 ["--config", CONFIG, "--steps", "2"],
                 ["--config", CONFIG, "--only", "seed0/*"],
                 []):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, argv
        assert err.startswith("python -m lp_jax.study: error:"), argv
    assert not list(tmp_path.rglob("verify.json"))


def test_losses_compare_exactly_as_stored():
    recorded = [{"step": 1, "loss": 5.5}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 4.0}]
    assert verify.compare(recorded, [dict(r) for r in recorded], 3) is None
    assert verify.compare(recorded, [{"step": 1, "loss": 5.5}, {"step": 2, "loss": float("nan")},
                                     {"step": 3, "loss": 4.000000000000001}], 3) == (3, 4.0, 4.000000000000001)
    assert verify.compare(recorded, recorded[:1], 2) == (2, recorded[1]["loss"], None)
    assert verify.compare(recorded, recorded[:2], 2) is None  # step 3 is past the steps compared


def test_the_report_names_what_differs_briefly():
    runs = [{"run": f"seed{s}/{n}", "same": s != 4, "step": None if s != 4 else 1,
             "recorded_loss": 1.0, "now_loss": 2.0, "recorded_by": {}}
            for s in range(6) for n in ("bf16", "fp8_cs")]
    check = {"command": "python -m lp_jax.study --verify docs/study_tiny", "steps": 3,
             "made_by": {"commit": "abc1234", "jax": "0.12.1"}, "runs": runs}
    text = "\n".join(verify.markdown({"checks": [check]}))
    assert "(commit abc1234, JAX 0.12.1) retrained each record's first 3 step(s)" in text
    assert "10 of 12 reproduce their recorded losses bit for bit; these differ:" in text
    assert "- seed4/bf16: at step 1 (recorded 1.0, now 2.0)" in text
    for r in runs:
        r.update(same=r["run"].startswith("seed5"), step=None if r["run"].startswith("seed5") else 1)
    text = "\n".join(verify.markdown({"checks": [check]}))
    assert "2 of 12 reproduce" in text and "seed0/* (2 runs), seed1/* (2 runs)" in text
    assert "differ from step 1." in text
