"""The tiny MoE's train step compiled for a B200 target: every expert GEMM (each group's
window, forward, dgrad and wgrad) is a native block-scaled GEMM in MXFP8, and the plan
counts one window per group (the one balanced routing takes). For an H200: FP8-CS's expert
GEMMs are native FP8 ones; MXFP8's are expanded by XLA (Hopper has no block-scaled MMA)."""
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


# The GEMMs no recipe quantizes in the 2-layer tiny MoE: the LM head (forward, dgrad, wgrad:
# BF16), the FP32 router (3 per layer) and attention's two score GEMMs with their four
# backward ones per layer (not through cuDNN at this head size on an H200).
KEPT_HIGH_PRECISION = 3 + 2 * 3 + 2 * 6


def _tiny_moe_row(tmp_path, capsys, gpu, recipe):
    out = tmp_path / f"{gpu}-{recipe}.json"
    code = cli.main(["--config", TINY_MOE, "--gpu", gpu, "--gpus", "1", "--recipes", recipe,
                     "--json", str(out), "model.num_layers=2", "data.seq_len=64", "data.global_batch_size=2",
                     "data.micro_batch_size=2", "data.source=mock", "precision.first_bf16_layers=0",
                     "precision.last_bf16_layers=0"])
    assert code == 0, capsys.readouterr().out
    return json.loads(out.read_text())["rows"][0]


@needs_plugin
def test_expert_gemms_are_native_fp8_on_h200_in_fp8_cs(tmp_path, capsys):
    row = _tiny_moe_row(tmp_path, capsys, "h200", "fp8_cs")
    types = row["gemm_operand_types"]
    # Every other GEMM, the experts' windows included, takes FP8 operands on Hopper (XLA may
    # split or merge a few, so their count is not fixed).
    assert types.get("bf16", 0) + types.get("fp32", 0) == KEPT_HIGH_PRECISION, types
    assert types["fp8"] >= 2 * 2 * 8 * 3, types


@needs_plugin
def test_mxfp8_expert_gemms_are_expanded_on_h200(tmp_path, capsys):
    # Hopper has no block-scaled MMA: the plan counts every MXFP8 GEMM as an XLA-expanded one
    # (dequantized to BF16), none as native.
    row = _tiny_moe_row(tmp_path, capsys, "h200", "mxfp8")
    attention, experts = 2 * 4 * 3, 2 * 2 * 8 * 1 * 3
    assert row["gemms"]["xla"] == attention + experts, row["gemms"]
    assert "fp8" not in row["gemm_operand_types"], row["gemm_operand_types"]
