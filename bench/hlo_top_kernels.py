"""Where a compiled GPU module's HBM traffic and time go: its kernels ranked by estimated
time per step (the plan's roofline), with their bytes, launches and whether they run in the
layer loops.

    python -m bench.hlo_top_kernels DIR/mxfp8.hlo.txt --gpu gb200 [--top 30] [--loops-only]

The module is one the plan wrote (``python -m lp_jax.plan ... --hlo-dir DIR``). Times are
the roofline's estimates, not measurements.
"""
from __future__ import annotations

import argparse
import sys

from lp_jax.plan.gpus import gpu as gpu_named
from lp_jax.plan.hlo_module import Module
from lp_jax.plan.kernels import kernels
from lp_jax.plan.roofline import kernel_seconds


def ranked(text: str, gpu_name: str, loops_only: bool = False) -> list[tuple[float, object]]:
    gpu = gpu_named(gpu_name)
    found = [k for k in kernels(Module.parse(text)) if k.collective is None and (k.looped or not loops_only)]
    return sorted(((kernel_seconds(k, gpu) * k.runs, k) for k in found), key=lambda tk: -tk[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hlo_top_kernels", description=__doc__.split("\n")[0])
    p.add_argument("hlo", help="an optimized module's text (the plan's --hlo-dir)")
    p.add_argument("--gpu", required=True)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--loops-only", action="store_true", help="only kernels inside while loops")
    args = p.parse_args(argv)
    with open(args.hlo) as f:
        rows = ranked(f.read(), args.gpu, args.loops_only)
    total = sum(t for t, _ in rows)
    print(f"{len(rows)} kernels, est. {total * 1e3:.2f} ms per step (roofline, not measured)\n")
    print("| est. ms | share | GB per step | launches | kernel | opcode | library | in loops |")
    print("|---|---|---|---|---|---|---|---|")
    for t, k in rows[:args.top]:
        print(f"| {t * 1e3:.3f} | {t / total:.1%} | {k.bytes * k.runs / 1e9:.3f} | {k.runs} | {k.name} | "
              f"{k.opcode} | {k.library or '-'} | {'yes' if k.looped else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
