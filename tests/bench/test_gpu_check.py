"""bench/gpu_check.sh runs only on a GPU machine, which is rarely at hand: every part of it
runs here at tiny shapes (``--tiny``) so the script is known to work before a GPU's
minutes are spent on it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hlo_gemms import compiled_gemms

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench/gpu_check.sh"


def test_the_parts_time_limits_fit_in_eight_minutes():
    limits = [int(n) for n in re.findall(r"^\s*part (\d+) ", SCRIPT.read_text(), re.M)]
    assert len(limits) == 7 and sum(limits) <= 8 * 60 - 15  # 15 s for starting JAX and python


@pytest.mark.slow
def test_gpu_check_runs_every_part_at_tiny_shapes_on_cpu():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT), "--tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for expected in ("backend check: ok", "GEMM TFLOP/s", "| 40x24 | wgrad |", "forward+backward",
                     "lp_jax nvfp4 (reference backend)", "tokens per step", "quantization kernels, 64x96",
                     "| nvfp4 x both copies (-; RHT) ", "gpu_check: ok"):
        assert expected in out, (expected, out[-3000:])
    assert re.search(r"\| nvfp4 +\| F0L1 +\| 21 ", out), out[-3000:]  # the last train-step row
    assert "!!" not in out and "skipped" not in out.split("== 3.")[1]


def test_compiled_gemm_census_reads_gpu_hlo():
    hlo = "\n".join([
        '%c = (f32[64,32]{1,0}, s8[0]{0}) custom-call(%a, %b, %s, %t), custom_call_target="__cublas$lt$matmul$f8"',
        '%d = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"',
        '%e = (f32[1,128,128]{2,1,0}, u8[0]{0}) custom-call(%p, %q, %r, %u), custom_call_target="__cudnn$blockScaledDot"',
        '%f = f32[8,8]{1,0} fusion(%x), kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '%g = f32[8,8]{1,0} custom-call(%x), custom_call_target="something_else"',
        '%h = f32[64,128]{1,0} custom-call(%a, %s, %b, %t), custom_call_target="mosaic_gpu_v2", '
        'metadata={op_name="jit(f)/lp_jax_fp8_block_gemm/mpmd_map"}',
        '%i = f8e4m3fn[64,128]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", '
        'metadata={op_name="jit(f)/mpmd_map"}',  # a quantization kernel: not a GEMM
    ])
    assert compiled_gemms(hlo) == {"__cublas$lt$matmul$f8": 1, "__cublas$lt$matmul": 1,
                                   "__cudnn$blockScaledDot": 1, "fusion __triton_gemm": 1,
                                   "lp_jax wgmma FP8 block GEMM": 1}
