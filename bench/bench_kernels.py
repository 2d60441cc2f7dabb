"""Pallas quantization kernels against the XLA quantizers: time, GB/s and share of the
chip's memory bandwidth, on one 8192x4096 bf16 tensor (a GPU table; the targets:
each kernel >= 60% of peak bandwidth and faster than XLA's fusions).

    python bench/bench_kernels.py [--rows 8192 --cols 4096] [--repeats 20] [--budget-s S]
    python bench/bench_kernels.py --tiny      # 64x96 in Pallas's GPU interpreter: a CPU smoke run
    python bench/bench_kernels.py --lower-cuda   # does each kernel lower for CUDA? (any machine)

GB/s counts the bytes a perfect kernel moves: the bf16 input read once and every output
(data and scales) written once; the amax pass that per-tensor scales need reads the input
a second time, which the figure does not credit. Each row first checks that both
implementations give the same bytes, so a fast wrong kernel cannot print a number.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import median_seconds, platform_line, print_table  # noqa: E402
from lp_jax.gemm.operands import Transposed, operand_pair, stored  # noqa: E402
from lp_jax.kernels.launch import cuda_lowering_error  # noqa: E402
from lp_jax.quantizer import quantize  # noqa: E402
from lp_jax.recipes import OperandSpec  # noqa: E402

# Memory bandwidth by device kind (bytes/s), for the "% of peak" column.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "GB200": 8.0e12}


def _peak():
    kind = getattr(jax.devices()[0], "device_kind", "")
    return next((bw for name, bw in PEAK_BANDWIDTH.items() if name in kind), None)


def _single(fmt, **kw):
    """lp.quantize of t (along its last axis unless kw says another)."""
    return lambda impl: lambda t, key: quantize(t, fmt, impl=impl, **kw)


def _pair(row: OperandSpec, col: OperandSpec):
    """Both 1-D block copies of t: along C (a QuantizedTensor) and along R (transposed)."""
    def make(impl):
        r, c = (OperandSpec(**{**s.__dict__, "quantize_impl": impl}) for s in (row, col))
        if impl == "xla":  # two separate quantizations, as the XLA path stores them
            return lambda t, key: (stored(t, r, 1, key), stored(t, c, 0, key))
        return lambda t, key: operand_pair(t, r, 1, c, 0, key, key, keep_b=True)
    return make


def _col(spec: OperandSpec):
    """The wgrad copy alone: blocked along R (the tokens), stored transposed."""
    return lambda impl: lambda t, key: stored(t, OperandSpec(**{**spec.__dict__, "quantize_impl": impl}), 0, key)


NV, NV_SR = OperandSpec("nvfp4"), OperandSpec("nvfp4", stochastic=True)
CASES = [  # name, maker, output bytes per element (data + scales)
    ("fp8_e4m3 per tensor", _single("fp8_e4m3"), 1.0),
    ("mxfp8 1x32 (rows)", _single("mxfp8"), 1 + 1 / 32),
    ("mxfp8 both copies (rows + transposed cols)", _pair(OperandSpec("mxfp8"), OperandSpec("mxfp8")), 2 + 2 / 32),
    ("mxfp8 1x32 along the first axis (cols in place)", _single("mxfp8", axis=0), 1 + 1 / 32),
    ("nvfp4 1x16 (rows)", _single("nvfp4"), 0.5 + 1 / 16),
    ("nvfp4 1x16 along the first axis (cols, swapped back)", _single("nvfp4", axis=0), 0.5 + 1 / 16),
    ("nvfp4 16x16 tiles", _single("nvfp4", block_2d=True), 0.5 + 1 / 256),
    ("nvfp4 wgrad dy: RHT + SR, transposed", _col(OperandSpec("nvfp4", rht=True, stochastic=True)), 0.5 + 1 / 16),
    ("nvfp4 dy both copies (SR; RHT+SR)", _pair(NV_SR, OperandSpec("nvfp4", rht=True, stochastic=True)), 1 + 2 / 16),
    ("nvfp4 x both copies (-; RHT)", _pair(NV, OperandSpec("nvfp4", rht=True)), 1 + 2 / 16),
]


def _leaves(out):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(out, is_leaf=lambda n: isinstance(n, Transposed))
            if hasattr(a, "dtype")]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and np.array_equal(
        x.view(np.uint8) if x.dtype.itemsize == 1 else x, y.view(np.uint8) if y.dtype.itemsize == 1 else y,
        equal_nan=x.dtype.itemsize > 1) for x, y in zip(la, lb))


def lower_for_cuda(rows, cols):
    """Lowers each Pallas kernel for CUDA from this machine, whatever its devices: Mosaic GPU's
    lowering runs on the host, so what it refuses shows without a GPU."""
    t = jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)
    key = jax.eval_shape(lambda: jax.random.key(1))
    table = []
    for name, make, _ in CASES:
        error = cuda_lowering_error(make("pallas"), t, key)
        table.append((name, "lowers" if error is None else error[:110]))
    print(platform_line())
    print_table(["kernel", "Mosaic GPU lowering for CUDA"], table, title=f"{rows}x{cols} bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new row after this")
    ap.add_argument("--tiny", action="store_true", help="64x96 in the GPU interpreter (a CPU smoke run)")
    ap.add_argument("--lower-cuda", action="store_true",
                    help="only lower each kernel for CUDA (Mosaic GPU, not interpreted) and say whether it lowers")
    args = ap.parse_args()
    if args.lower_cuda:
        return lower_for_cuda(args.rows, args.cols)
    if args.tiny:
        args.rows, args.cols, args.repeats, args.budget_s = 64, 96, 1, None
    print(platform_line())
    t = jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.bfloat16)
    key = jax.random.key(1)
    peak = _peak()
    rows, start = [], time.perf_counter()
    for name, make, out_bytes in CASES:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"(time budget of {args.budget_s:.0f} s spent: remaining rows skipped)")
            break
        xla, pallas = jax.jit(make("xla")), jax.jit(make("pallas"))
        try:
            got = pallas(t, key)
        except Exception as e:  # noqa: BLE001 - a kernel Mosaic GPU cannot compile yet: say so, go on
            rows.append((name, "-", "-", "-", "-", f"NOT COMPILED: {type(e).__name__}: {str(e).splitlines()[0][:70]}"))
            continue
        if not _same(got, xla(t, key)):
            rows.append((name, "-", "-", "-", "-", "DIFFERENT BYTES"))
            continue
        tx = median_seconds(xla, t, key, repeats=args.repeats)
        tp = median_seconds(pallas, t, key, repeats=args.repeats)
        nbytes = t.size * (2 + out_bytes)
        gbs = nbytes / tp / 1e9
        share = f"{100 * nbytes / tp / peak:.0f}%" if peak else "-"
        rows.append((name, f"{tx * 1e3:.3f}", f"{tp * 1e3:.3f}", f"{tx / tp:.2f}", f"{gbs:.0f}", share))
    print_table(["kernel", "XLA ms", "Pallas ms", "XLA/Pallas", "Pallas GB/s", "of peak BW"], rows,
                title=f"quantization kernels, {args.rows}x{args.cols} bf16, median of {args.repeats}"
                      f"{'' if peak else ' (peak bandwidth of this device not known)'}")
    if any(r[-1] == "DIFFERENT BYTES" for r in rows):
        sys.exit("!! a Pallas kernel gave different bytes from the XLA path")


if __name__ == "__main__":
    main()
