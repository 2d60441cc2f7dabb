#!/usr/bin/env bash
# The GPU check, in under 8 minutes on one H200: correctness of every GEMM backend first,
# then the timing tables, then a few train steps per recipe, then the Pallas quantization kernels (docs/backends.md,
# docs/benchmarks.md). Run it on a GPU machine (JAX with CUDA installed there), from
# the repository root:
#     bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
#     bash bench/gpu_check.sh --tiny     # every part at tiny shapes: a CPU smoke run
#                                        # (tests/bench/test_gpu_check.py runs it)
# Part 2 needs pytest on that machine (the `test` extra); without it, part 2 is skipped.
# Each part has its own time limit (they add up to 7 min 45 s) and the timing scripts stop
# starting new rows when their budget is spent, so a slow machine still leaves every table,
# shortened.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"  # the interpreter with JAX (the test suite passes its own)
TINY=""
SLOWER=1  # the time limits are for the GPU; a CPU smoke run takes its time (and no budgets)
[[ "${1:-}" == "--tiny" ]] && TINY="--tiny" && SLOWER=4
status=0

part() {  # part LIMIT_S COMMAND...: run it, report a failure or a timeout, go on
  local limit=$(($1 * SLOWER)); shift
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 124 ]]; then
    echo "!! timed out after ${limit} s: $*"; status=1
  elif [[ $rc -ne 0 ]]; then
    echo "!! failed (exit $rc): $*"; status=1
  fi
  echo "   ($((SECONDS - start)) s)"
}

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1

echo "== 1. GEMM backends: each compiles, runs, equals the reference; GEMMs of the optimized HLO"
part 80 "$PY" bench/backend_check.py $TINY

echo "== 2. bit-exact quantizers and reference GEMMs on this backend; the Hopper FP8 block GEMM kernel"
if [[ -n "$TINY" ]]; then
  echo "   skipped with --tiny (the test suite runs these on CPU)"
elif "$PY" -c "import pytest" 2>/dev/null; then
  part 80 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/numerics/test_quantize_formats.py \
    tests/numerics/test_quantize_tensor_scales.py tests/numerics/test_division.py tests/gemm/test_dot_general.py \
    tests/test_jax_apis.py \
    tests/kernels/test_fp8_block_gemm.py
else
  echo "   pytest missing: skipped"
fi

echo "== 3. GEMM TFLOP/s at Llama 3 8B shapes, M = 8192 tokens (quantization included, excluded)"
part 85 "$PY" bench/bench_gemms.py --tokens 8192 --budget-s 65 --recipes fp8_cs,fp8_block,mxfp8,nvfp4,mxfp8@xla_scaled_dot \
  $TINY

echo "== 4. one transformer layer (Llama 3 8B width) forward+backward per recipe"
part 65 "$PY" bench/bench_dot_general.py --mode block --layers 1 --tokens 8192 --d 4096 --ffn 14336 \
  --heads 32 --repeats 5 --no-peers --no-fp32 --reference-backend --budget-s 45 $TINY

echo "== 5. llama3_1b train steps per recipe: tokens/s, MFU"
part 75 "$PY" bench/train_throughput.py --preset llama3_1b --seq-len 2048 --batch 4 --steps 4 \
  --budget-s 52 $TINY

echo "== 6. Pallas quantization kernels against XLA's quantizers, 8192x4096 bf16: ms, GB/s, share of peak"
part 40 "$PY" bench/bench_kernels.py --rows 8192 --cols 4096 --budget-s 25 $TINY

echo "== 7. the plan's estimate for part 5's steps (python -m lp_jax.plan, deviceless, docs/plan.md)"
if [[ -n "$TINY" ]]; then
  echo "   not run with --tiny (tests/plan runs the plan at tiny shapes)"
elif "$PY" -c "import sys; from lp_jax.plan.environment import plugin_problem; sys.exit(1 if plugin_problem() else 0)"; then
  part 40 "$PY" -m lp_jax.plan --config configs/tiny.yaml --gpu h200 --gpus 1 --recipes bf16,fp8_cs \
    model.preset=llama3_1b model.scan_layers=true data.seq_len=2048 data.global_batch_size=4 \
    data.micro_batch_size=4 data.source=mock
else
  echo "   not run: JAX's CUDA plugin is missing"
fi

echo "== gpu_check: $([[ $status -eq 0 ]] && echo ok || echo FAILED)"
exit $status
