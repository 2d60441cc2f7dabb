"""The tiny MoE's train step compiled for a B200 target: every expert GEMM (each group's
window, forward, dgrad and wgrad) is a native block-scaled GEMM in MXFP8, and the plan
counts one window per group (the one balanced routing takes)."""
import json
import os

import pytest

from lp_jax.plan import cli
from tests.support.plan_targets import ROOT, needs_plugin

pytestmark = pytest.mark.gpu_compile
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")


@needs_plugin
def test_every_expert_gemm_is_block_scaled_on_b200(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # 2 layers, 2 x 64 tokens routed to 2 experts each: 256 rows, windows of 128 and 256; the
    # plan counts the window of an even share (32 rows: 128), the switch's expected branch.
    code = cli.main(["--config", TINY_MOE, "--gpu", "b200", "--gpus", "1", "--recipes", "mxfp8",
                     "--json", str(out), "model.num_layers=2", "data.seq_len=64", "data.global_batch_size=2",
                     "data.micro_batch_size=2", "data.source=mock", "precision.first_bf16_layers=0",
                     "precision.last_bf16_layers=0"])
    assert code == 0, capsys.readouterr().out
    row = json.loads(out.read_text())["rows"][0]
    attention = 2 * 4 * 3  # q, k, v, o in 2 layers: forward, dgrad, wgrad
    experts = 2 * 2 * 8 * 1 * 3  # gate_up and down in 2 layers, 8 groups, 1 window counted each
    assert row["gemms"]["cudnn_block_scaled"] == attention + experts, row["gemms"]
    assert row["memory"]["fits"]
