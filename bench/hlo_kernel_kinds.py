"""What kinds of kernels a recipe adds inside the layer loops: two compiled GPU modules (a
base, usually BF16's, and a recipe's) side by side, their loop kernels' launches per step
grouped by kind, largest difference first.

    python -m bench.hlo_kernel_kinds DIR/bf16.hlo.txt DIR/nvfp4.hlo.txt

A kind is a custom call's target (cuDNN's GEMMs and attention, ``mosaic_gpu_v2`` for the
Pallas kernels) or a fusion named by its root and what else it holds (a reduction, a
transpose, 8-bit values). A last row counts the **weight-only** kernels: those whose
inputs are, through the loop body, only the loop's stacked float32 arrays ([layers, ...]
of three or more axes: the scanned layers' master weights), scalars and constants, so their work repeats
for every micro-batch although it depends on the weights alone. (A kernel reading a weight
scale that the forward saved for the backward is not counted: a lower bound.)

The modules are the plan's (``python -m lp_jax.plan ... --hlo-dir DIR``); counts are
launches per step, so at 2 layers each loop kernel counts twice.
"""
from __future__ import annotations

import argparse
import collections
import sys

from lp_jax.plan.hlo_module import Module, arrays
from lp_jax.plan.kernels import kernels

EIGHT_BIT = ("f8e4m3fn", "f8e5m2", "f8e8m0fnu", "f4e2m1fn", "u8")


def _kind(module: Module, instr) -> str:
    if instr.opcode == "custom-call":
        return f"custom-call {instr.custom_call_target or '?'}"
    if instr.opcode not in ("fusion", "fusion-start"):
        return instr.opcode
    body = module.computations[instr.attr("calls")]
    ops = {i.opcode for i in body.instructions}
    narrow = any(dtype in EIGHT_BIT for i in body.instructions for dtype, _ in arrays(i.shape))
    root = body.root.opcode
    extras = [name for name, present in (("reduce", "reduce" in ops), ("transpose", "transpose" in ops),
                                         ("8-bit", narrow)) if present and name != root]
    return f"fusion {root}" + "".join(f" +{e}" for e in extras)


def _weight_only(by_name: dict, layers: set[int]):
    """name -> whether an instruction's value depends on stacked float32 loop arrays (leading
    axis a layer count) and otherwise only on scalars and constants."""
    memo: dict[str, str | None] = {}  # "weight", "scalar" (scalars and constants) or None

    def loop_value(shape: str) -> str | None:
        found = arrays(shape)
        if len(found) != 1:
            return None
        dtype, dims = found[0]
        if not dims:
            return "scalar"
        return "weight" if dtype == "f32" and len(dims) >= 3 and dims[0] in layers else None

    def source(name: str) -> str | None:
        if name in memo:
            return memo[name]
        instr = by_name.get(name)
        memo[name] = None  # a parameter (or an unknown name) ends the walk
        if instr is None or instr.opcode == "parameter":
            return None
        if instr.opcode == "constant":
            result = "scalar"
        elif instr.opcode == "get-tuple-element" and by_name[instr.operands[0]].opcode == "parameter":
            result = loop_value(instr.shape)
        else:
            found = [source(o) for o in instr.operands]
            result = None if None in found or not found else ("weight" if "weight" in found else "scalar")
        memo[name] = result
        return result

    return lambda name: source(name) == "weight"


def kinds(text: str) -> tuple[collections.Counter, int]:
    """(launches per step by kind, weight-only launches) of the module's loop kernels."""
    module = Module.parse(text)
    by_name = {i.name: i for c in module.computations.values() for i in c.instructions}
    weight_only = _weight_only(by_name, set(module.trip_counts()))
    counts, weights = collections.Counter(), 0
    for k in kernels(module):
        if not k.looped or k.collective is not None:
            continue
        counts[_kind(module, by_name[k.name])] += k.runs
        weights += k.runs if weight_only(k.name) else 0
    return counts, weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hlo_kernel_kinds", description=__doc__.split("\n")[0])
    p.add_argument("base", help="the base module's text (the plan's --hlo-dir), e.g. bf16.hlo.txt")
    p.add_argument("other", help="the recipe's module")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    (base, base_w), (other, other_w) = (kinds(open(path).read()) for path in (args.base, args.other))
    rows = sorted(set(base) | set(other), key=lambda kind: (-(other[kind] - base[kind]), kind))
    print("Loop kernel launches per step (a kernel of an n-layer loop counts n times)\n")
    print("| kind | base | other | difference |")
    print("|---|---|---|---|")
    for kind in rows[:args.top]:
        print(f"| {kind} | {base[kind]} | {other[kind]} | {other[kind] - base[kind]:+d} |")
    print(f"| all | {sum(base.values())} | {sum(other.values())} | "
          f"{sum(other.values()) - sum(base.values()):+d} |")
    print(f"| of which weight-only | {base_w} | {other_w} | {other_w - base_w:+d} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
