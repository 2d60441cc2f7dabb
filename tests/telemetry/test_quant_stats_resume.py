"""quant_stats.jsonl in a training run: written every logging.quant_stats_every steps, and
after a stop and a resume it equals the uninterrupted run's, whatever the interrupted
session wrote after its last checkpoint."""
import json

import pytest

from lp_jax.telemetry.writer import FILE, read_quant_stats
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve
from tests.training.test_training_loop import tiny

# Two layers, the last kept in BF16: FP8-CS, whose per-tensor statistics are quick to compile.
SMALL = ["steps=4", "model.num_layers=2", "precision=fp8_cs", "precision.first_bf16_layers=0",
         "logging.quant_stats_every=2", "logging.val_batches=0", "checkpoint.every=2"]


@pytest.mark.slow
def test_quant_stats_resume_equals_straight_run(tmp_path, token_cache):
    run(resolve(tiny(tmp_path / "a", token_cache, *SMALL)))
    straight = read_quant_stats(tmp_path / "a")
    assert [r["step"] for r in straight] == [2, 4]
    first = straight[0]
    assert (first["recipe"], first["policy"]) == ("fp8_cs", "F0L1")
    assert [(r["layer"], r["bf16"]) for r in first["layers"]][::7] == [(0, False), (1, True)]
    assert len(first["layers"]) == 14  # 7 Linears per Llama layer
    sqnr = first["layers"][0]["operands"]["fprop_x"]["sqnr_db"]
    assert 20 < sqnr < 40  # E4M3 per tensor: about 30 dB on activations

    run(resolve(tiny(tmp_path / "b", token_cache, *SMALL, "stop_at=2")))
    # what a session killed after its checkpoint could have left behind
    with open(tmp_path / "b" / FILE, "a") as f:
        f.write(json.dumps({"schema": 1, "step": 3, "layers": []}) + "\n")
    run(resolve(tiny(tmp_path / "b", token_cache, *SMALL)))
    assert read_quant_stats(tmp_path / "b") == straight
    # the probe changes nothing in training: the same losses as a run without it
    run(resolve(tiny(tmp_path / "c", token_cache, *SMALL, "logging.quant_stats_every=0")))
    assert not (tmp_path / "c" / FILE).exists()
    losses = [[m["loss"] for m in read_metrics(tmp_path / d)] for d in "abc"]
    assert len(losses[0]) == 4 and losses[0] == losses[1] == losses[2]
