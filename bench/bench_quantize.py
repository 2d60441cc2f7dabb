"""Quantize + dequantize throughput per format against a plain elementwise pass.

    python bench/bench_quantize.py [--size 4096] [--repeats 10] [--record NAME]

--record NAME also writes the table to bench/records/<NAME>.json for `python -m bench.results`.

Each format is a few passes over memory (amax, scale, cast; then decode); the target is
every format within 6x of one plain elementwise pass over the same bf16 tensor.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax as lp  # noqa: E402
from bench.common import median_seconds, platform_line, print_table  # noqa: E402
from bench.results import machine, write_record  # noqa: E402
from bench.results.records import NAME  # noqa: E402

CASES = [
    ("fp8_e4m3 (per tensor)", dict(fmt="fp8_e4m3")),
    ("fp8_e5m2 (per tensor)", dict(fmt="fp8_e5m2")),
    ("mxfp8 (1x32, rceil)", dict(fmt="mxfp8")),
    ("nvfp4 (1x16)", dict(fmt="nvfp4")),
    ("nvfp4 (16x16)", dict(fmt="nvfp4", block_2d=True)),
    ("nvfp4 (1x16, stochastic)", dict(fmt="nvfp4", rounding="stochastic")),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--record", metavar="NAME", help="also write the table to bench/records/<NAME>.json")
    args = ap.parse_args()
    if args.record and not NAME.fullmatch(args.record):  # before the minutes of timing, not after
        ap.error(f"--record {args.record!r}: lowercase words joined by '-'")
    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    nbytes = x.size * 2
    plain = jax.jit(lambda x: (x * 1.5 + 0.25).astype(jnp.bfloat16))
    base = median_seconds(plain, x, repeats=args.repeats)
    rows = [("plain elementwise (x*a+b)", f"{base * 1e3:.2f}", f"{2 * nbytes / base / 1e9:.1f}", "1.00")]
    for name, kw in CASES:
        key = jax.random.key(1) if kw.get("rounding") == "stochastic" else None
        fn = jax.jit(lambda x, key, kw=kw: lp.dequantize(lp.quantize(x, key=key, **kw)).astype(jnp.bfloat16))
        t = median_seconds(fn, x, key, repeats=args.repeats)
        # bytes: the bf16 input read and the bf16 result written, as for the plain pass
        rows.append((name, f"{t * 1e3:.2f}", f"{2 * nbytes / t / 1e9:.1f}", f"{t / base:.2f}"))
    columns = ["quantize+dequantize", "ms", "GB/s (in+out)", "x plain pass"]
    print(platform_line())
    print_table(columns, rows, title=f"{args.size}x{args.size} bf16, median of {args.repeats}")
    if args.record:
        path = write_record(
            args.record, f"Quantize + dequantize of a {args.size}x{args.size} bf16 tensor per format",
            shlex.join(["python", "bench/bench_quantize.py", *sys.argv[1:]]), columns, rows, machine(),
            note=f"Median of {args.repeats} timed calls per row, after a warm-up call that compiles.")
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
