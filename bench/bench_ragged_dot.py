"""The emulated grouped GEMM (lp.ragged_dot) against a per-expert loop of lp.dot_general.

    python bench/bench_ragged_dot.py [--repeats 9] [--record NAME]

--record NAME also writes the table to bench/records/<NAME>.json for `python -m bench.results`.

Forward and backward (dx, dW) of the tiny MoE's gate/up GEMM for one step: 4096 routed rows
(8 sequences of 256 tokens, 2 experts each), K=128, N=192, 8 experts of uneven sizes. The
loop knows the sizes when it is traced (one dense GEMM per expert on exactly its rows); the
grouped GEMM takes them as data, as a router gives them. The target is 1.3x the loop.
"windows x loop" is the same loop on each expert's rows zero-padded to its window (what
lp.ragged_dot multiplies, ``window_sizes``): the share of the cost the padding explains.
The three are timed in interleaved rounds (bench/common.py: interleaved_seconds), so the
ratios hold under a changing load.
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
from lp_jax.gemm.ragged_dot import window_sizes  # noqa: E402
from bench.common import interleaved_seconds, platform_line, print_table  # noqa: E402
from bench.results import machine, write_record  # noqa: E402
from bench.results.records import NAME  # noqa: E402

SIZES = (1200, 300, 900, 100, 500, 400, 296, 400)
K, N = 128, 192
LINEAR = (((1,), (0,)), ((), ()))


def _step(f, dy):
    """y, dx and dW of f(x, w, *rest) (returning y keeps the forward GEMMs from being left
    out as dead code); ``rest`` (the group sizes) is an argument, so it is data when compiled."""
    def step(x, w, *rest):
        y, vjp = jax.vjp(lambda x, w: f(x, w, *rest), x, w)
        return y, vjp(dy)
    return jax.jit(step)


def _loop(dense, windows=False):
    """One dense GEMM per expert on exactly its rows, or (windows) on its rows zero-padded to
    its window."""
    starts = [sum(SIZES[:g]) for g in range(len(SIZES))]
    if not windows:
        return lambda x, w: jnp.concatenate([dense(x[s:s + n], w[g], LINEAR)
                                             for g, (s, n) in enumerate(zip(starts, SIZES))])
    lengths = [next(r for r in window_sizes(sum(SIZES)) if r >= n) for n in SIZES]

    def loop(x, w):
        padded = [jnp.pad(x[s:s + n], ((0, rows - n), (0, 0))) for s, n, rows in zip(starts, SIZES, lengths)]
        return jnp.concatenate([dense(p, w[g], LINEAR)[:n] for g, (p, n) in enumerate(zip(padded, SIZES))])
    return loop


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--record", metavar="NAME", help="also write the table to bench/records/<NAME>.json")
    args = ap.parse_args()
    if args.record and not NAME.fullmatch(args.record):
        ap.error(f"--record {args.record!r}: lowercase words joined by '-'")
    m = sum(SIZES)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (len(SIZES), K, N), jnp.float32) * 0.05
    dy = jax.random.normal(kd, (m, N), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    rows = []
    for recipe in ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"):
        grouped, dense = lp.ragged_dot(recipe), lp.dot_general(recipe)
        steps = {"loop": _step(_loop(dense), dy), "windows": _step(_loop(dense, windows=True), dy),
                 "grouped": _step(grouped, dy)}
        t = interleaved_seconds(steps, {"loop": (x, w), "windows": (x, w), "grouped": (x, w, sizes)}, "loop",
                                repeats=args.repeats)
        rows.append((recipe, f"{t['grouped'][0] * 1e3:.1f}", f"{t['loop'][0] * 1e3:.1f}",
                     f"{t['grouped'][1]:.2f}", f"{t['windows'][1]:.2f}"))
    columns = ["recipe", "lp.ragged_dot ms", "per-expert loop ms", "x loop", "windows x loop"]
    print(platform_line())
    print_table(columns, rows, title=f"{m}x{K} @ {len(SIZES)}x{K}x{N}, forward and backward, median of {args.repeats}")
    if args.record:
        path = write_record(
            args.record, f"Grouped GEMM of {len(SIZES)} experts, {m} rows, forward and backward",
            shlex.join(["python", "bench/bench_ragged_dot.py", *sys.argv[1:]]), columns, rows, machine(),
            note=f"Medians of {args.repeats} interleaved rounds after a warm-up call that compiles; "
                 "x loop: the median of the rounds' ratios.")
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
