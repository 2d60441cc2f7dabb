"""Records of finished runs (--records): a study keeps each finished run's configs and
metrics without checkpoints, and a study on a machine that has only those records reuses
the runs instead of training them again."""
import json
import os

import pytest

from lp_jax.config.yaml_io import dump_yaml
from lp_jax.study import memory, records
from lp_jax.study.study import StudyOptions, plan_seeds, run_study

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "tiny.yaml")


def _options(out, **kw):
    return StudyOptions(CONFIG, ("steps=4",), precisions="bf16,fp8_cs", out=out, seeds=(0, 1),
                        tasks=(), xla_memory=False, train=False, **kw)


def _plant(config, final_val):
    """A finished run folder as the trainer leaves it: its config.yaml, metrics to step 4
    with validation at 2 and 4, a checkpoint folder."""
    run_dir = config.run_dir
    os.makedirs(os.path.join(run_dir, "checkpoints", "4", "state"))
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(dump_yaml(config))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(1, 5):
            line = {"step": step, "loss": 3.0, "step_time_s": 0.5, "tokens_per_sec": 128.0}
            if step % 2 == 0:
                line["val_loss"] = final_val if step == 4 else final_val + 0.5
            f.write(json.dumps(line) + "\n")


def test_a_study_from_records_alone_reuses_every_run_and_reports_the_same_gaps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(memory, "memory_table_row", lambda *a, **k: None)
    for seed, planned in plan_seeds(_options("a")).items():
        for i, (_, config) in enumerate(planned):
            _plant(config, 2.0 + 0.1 * seed + 0.01 * i)
    said = []
    first = run_study(_options("a", records="recs"), said.append)
    kept = sorted(os.path.relpath(os.path.join(d), "recs") for d, _, files in os.walk("recs")
                  if "metrics.jsonl" in files)
    assert kept == [f"seed{s}/{n}" for s in (0, 1) for n in ("bf16", "bf16_twin", "fp8_cs")]
    assert not list((tmp_path / "recs").rglob("checkpoints"))  # configs and metrics only
    saved = (tmp_path / "recs" / "seed1" / "fp8_cs" / "config.yaml").read_text()
    assert "run_dir: seed1/fp8_cs\n" in saved and str(tmp_path) not in saved
    trained_on = json.loads((tmp_path / "recs" / "seed1" / "fp8_cs" / "machine.json").read_text())
    assert trained_on == records.machine() and trained_on["jax"] and trained_on["cpu"]
    assert sum("record kept in" in line for line in said) == 6

    said = []
    again = run_study(_options("b", records="recs"), said.append)  # a machine with no runs
    assert again["unfinished"] == []
    assert sum("restored its record" in line for line in said) == 6
    assert again["seeds"]["runs"]["fp8_cs"]["gap"] == pytest.approx(first["seeds"]["runs"]["fp8_cs"]["gap"])
    assert again["runs"]["fp8_cs"]["status"] == "complete"
    assert not (tmp_path / "b" / "runs" / "seed0" / "bf16" / "checkpoints").exists()

    # Without the records, the same empty folders are runs still to train.
    assert len(run_study(_options("c"), said.append)["unfinished"]) == 6


def test_a_record_short_of_its_target_or_onto_a_run_of_its_own_is_not_restored(tmp_path):
    record, run_dir = tmp_path / "rec", tmp_path / "run"
    record.mkdir()
    (record / "config.yaml").write_text("steps: 4\n")
    (record / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                  for s in range(1, 4)))
    assert not records.finished(record, 4) and not records.restore(record, run_dir, 4)
    assert not run_dir.exists()
    with open(record / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("steps: 4\nseed: 1\n")  # another run's folder
    assert records.finished(record, 4) and not records.restore(record, run_dir, 4)
    assert (run_dir / "config.yaml").read_text() == "steps: 4\nseed: 1\n"
    (run_dir / "config.yaml").unlink()
    assert records.restore(record, run_dir, 4)
    assert (run_dir / "metrics.jsonl").read_text() == (record / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="not under the runs folder"):
        records.record_path(tmp_path / "recs", tmp_path / "runs", tmp_path / "elsewhere" / "bf16")
