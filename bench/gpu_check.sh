#!/usr/bin/env bash
# The GPU check: correctness of the GPU paths, then a table of timings, in under 8 minutes.
# Run it on a GPU machine (JAX with CUDA installed there), from the repository root:
#     bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
# Part 1 needs pytest on that machine (the `test` extra); without it, part 1 is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1

echo "== 1. bit-exact quantizers and reference GEMMs on the GPU backend"
if python3 -c "import pytest" 2>/dev/null; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quantize_formats.py \
    tests/test_quantize_edge_cases.py tests/test_quantize_tensor_scales.py tests/test_hadamard.py \
    tests/test_stochastic_rounding.py tests/test_dot_general.py tests/test_jax_apis.py || status=1
else
  echo "pytest missing: part 1 skipped"
fi

echo "== 2. quantization survives GPU compilation (excess-precision folding)"
timeout 60 python3 bench/gpu_hlo_check.py || status=1

echo "== 3. timings"
timeout 150 python3 bench/bench_dot_general.py --layers 2 --tokens 8192 --d 4096 --ffn 14336 \
  --heads 32 --repeats 10 --no-peers || status=1
timeout 60 python3 bench/bench_quantize.py --size 8192 || status=1
exit $status
