"""Resuming over damaged checkpoints and with another model (docs/bad_input.md, cases 5
and 6): the newest checkpoint that restores is used and the run goes on exactly; with
none, or with another model's, one line and exit 2, the folder untouched."""
import json
import shutil

import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import ValidatedRun, model_shape_changes, resolve
from tests.support.bad_input import array_files, only_line, run, stopped_run, tiny, train, truncate  # noqa: F401 (fixtures)


def _truncate_largest_array_file(step):
    truncate(max(array_files(step), key=lambda p: p.stat().st_size))


def _empty(step):
    shutil.rmtree(step)
    step.mkdir()


DAMAGE = {
    "truncated array file": _truncate_largest_array_file,
    "garbled array metadata": lambda step: (step / "state" / "_METADATA").write_text("{garbled"),
    "garbled meta item": lambda step: (step / "meta" / "metadata").write_text("{garbled"),
    "missing state item": lambda step: shutil.rmtree(step / "state"),
    "missing data item": lambda step: shutil.rmtree(step / "data"),
    "empty step folder": _empty,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_skips_a_damaged_latest_checkpoint(damage, run, token_cache, capsys):
    before = {m["step"]: m["loss"] for m in read_metrics(run)}
    DAMAGE[damage](run / "checkpoints" / "4")
    rc, out, err = train(capsys, tiny(run, token_cache))
    # No traceback, not even the hundreds that Orbax's abandoned array reads print (quiet_reads.py).
    assert rc == 0 and "Traceback" not in err
    warning = next(line for line in out.splitlines() if line.startswith("warning: checkpoint 4"))
    assert warning.startswith(f"warning: checkpoint 4 in {run / 'checkpoints'} cannot be restored (")
    assert warning.endswith("; set aside as 4.damaged")
    assert "resumed from step 2" in out
    # The damaged folder is kept aside; steps 4 and 6 are written anew.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["2", "4", "4.damaged", "6"]
    after = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    assert [after[s] for s in (1, 2, 3, 4)] == [before[s] for s in (1, 2, 3, 4)]  # exact resume


def test_no_usable_checkpoint_is_one_line_and_touches_nothing(run, token_cache, capsys):
    for step in ("2", "4"):
        (run / "checkpoints" / step / "meta" / "metadata").write_text("{garbled")
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    metrics, config = (run / "metrics.jsonl").read_text(), (run / "config.yaml").read_text()
    rc, _, err = train(capsys, tiny(run, token_cache, "seed=7"))
    assert rc == 2
    assert error_text(err) == (f"checkpoint.dir: no checkpoint in '{run / 'checkpoints'}' can be "
                               "restored (steps 4, 2); move the folder aside to start afresh")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing
    assert (run / "metrics.jsonl").read_text() == metrics
    assert (run / "config.yaml").read_text() == config  # still the checkpoints' config


def test_no_usable_checkpoint_from_the_real_command(run, token_cache):
    """The same through `python train.py`: Orbax's own logs of the failures, and the
    tracebacks of its abandoned reads, stay quiet."""
    import subprocess
    import sys

    from tests.support.bad_input import ROOT

    # Every array file of step 4 cut short: Orbax's abandoned reads would print hundreds of
    # tracebacks to stderr, which is checked whole (quiet_reads.py).
    for path in array_files(run / "checkpoints" / "4"):
        truncate(path)
    (run / "checkpoints" / "2" / "state" / "_METADATA").write_text("{garbled")
    proc = subprocess.run([sys.executable, "train.py", *tiny(run, token_cache)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == (f"train.py: error: checkpoint.dir: no checkpoint in "
                           f"'{run / 'checkpoints'}' can be restored (steps 4, 2); move the "
                           "folder aside to start afresh\n")
    assert "warning: checkpoint 2" in proc.stdout and "_METADATA" not in proc.stderr


def error_text(err):
    return only_line(err).removeprefix("train.py: error: ")


def test_resume_with_another_model_shape_names_the_keys(run, token_cache, capsys):
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    config = (run / "config.yaml").read_text()
    rc, _, err = train(capsys, tiny(run, token_cache, "model.hidden_size=64"))
    assert rc == 2
    assert error_text(err) == (
        f"checkpoint 4 in '{run / 'checkpoints'}' is of another model: model.hidden_size "
        "(checkpoint 128, now 64); model keys cannot change on resume (precision, mesh and "
        "schedule can): use another run_dir for this model")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing  # nothing set aside
    assert (run / "config.yaml").read_text() == config  # eval.py still builds the 128 model


def _plan(run_dir, *overrides) -> ValidatedRun:
    return resolve(load_config(None, ["data.source=mock", f"run_dir={run_dir}", *overrides]))


def _saved(*overrides) -> dict:
    from lp_jax.config.yaml_io import to_dict

    return json.loads(json.dumps(to_dict(load_config(None, ["data.source=mock", *overrides]))))


@pytest.mark.parametrize("saved, now, changes", [
    ([], ["model.hidden_size=128"], []),  # the preset's value written out is no change
    ([], ["precision=fp8_cs", "mesh.data=1", "schedule.peak_lr=1e-3", "model.remat=full"], []),
    ([], ["model.fused_projections=true"], []),  # converted on resume (tests/runs/test_projection_layout.py)
    (["model.num_layers=2"], [], ["model.num_layers (checkpoint 2, now 4)"]),
    ([], ["model.tie_embeddings=true", "model.vocab_size=512"],
     ["model.vocab_size (checkpoint 384, now 512)", "model.tie_embeddings (checkpoint False, now True)"]),
])
def test_which_model_keys_block_a_resume(saved, now, changes, tmp_path):
    assert model_shape_changes(_saved(*saved), _plan(tmp_path, *now)) == changes


def test_a_tokenizer_change_shows_as_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    words = {f"w{i}": i for i in range(598)} | {"<s>": 598, "</s>": 599}
    Tokenizer(models.WordLevel(words, unk_token="<s>")).save(str(tmp_path / "tokenizer.json"))
    saved = _saved(f"data.tokenizer=hf:{tmp_path / 'tokenizer.json'}", "data.source=text")
    plan = resolve(load_config(None, [f"run_dir={tmp_path / 'run'}"]))  # bytes: 259 ids, vocab 384
    assert plan.tokenizer.vocab_size == ByteTokenizer.vocab_size
    assert model_shape_changes(saved, plan) == ["model.vocab_size (checkpoint 640, now 384)"]
