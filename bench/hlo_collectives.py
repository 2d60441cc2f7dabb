"""Collective bytes per device in a compiled (SPMD-partitioned) HLO module's text.

Each all-gather / reduce-scatter / all-reduce / all-to-all / collective-permute counts the
bytes of its operands (what one device sends into it), times how often it runs: once in
the entry computation, ``n`` times inside a while loop with ``known_trip_count`` n (the
layer scan and the micro-batch scan nest, so their counts multiply). Async pairs count
their ``-start`` half once.
"""
from __future__ import annotations

import collections
import json
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
          "f8e8m0fnu": 1, "f4e2m1fn": 1}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (arrays, or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _BYTES:
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _computations(text: str):
    """{computation name: [instruction lines]} and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _multipliers(comps, entry) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    mult = collections.Counter({entry: 1})
    order = [entry]
    for name in order:
        for line in comps.get(name, ()):
            m = _INSTR.match(line)
            if not m:
                continue
            op, rest = m.group(3), m.group(4)
            callees = []
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                if body:
                    callees.append((body.group(1), int(trips.group(1)) if trips else 1))
            elif op in ("call", "conditional", "async-start") or op.endswith("-start"):
                for callee in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%?([\w.\-,% ]+)", rest):
                    callees += [(c.strip().lstrip("%"), 1) for c in callee.split(",") if c.strip()]
            for callee, n in callees:
                if callee in comps:
                    mult[callee] += mult[name] * n
                    if callee not in order:
                        order.append(callee)
    return mult


def collective_bytes(text: str) -> dict[str, int]:
    """{kind: operand bytes per device per execution} for the KINDS, from HLO text."""
    comps, entry = _computations(text)
    shapes = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
    mult = _multipliers(comps, entry)
    out = dict.fromkeys(KINDS, 0)
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3).removesuffix("-start")
            if op not in KINDS or m.group(3).endswith("-done"):
                continue
            args = m.group(4).split(")", 1)[0]
            operands = re.findall(r"%([\w.\-]+)", args)
            inline = shape_bytes(args)
            size = inline or sum(shape_bytes(shapes.get(o, "")) for o in operands)
            out[op] += size * mult.get(name, 0)
    return out


_LAYOUT_OPS = ("convert", "bitcast", "copy", "transpose", "reshape")


def _instructions(comps) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (shape, opcode, rest of the line)} over all computations."""
    table = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                table[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return table


def _wire_dtype(operand: str, table, comps) -> str | None:
    """The element type an all-gather's operand had before XLA:CPU widened it: XLA:CPU
    gathers bf16 as f32 and FP8 as f16 by converting right before the collective. Follows
    the operand back through layout ops (and into a fusion's root) to the nearest convert,
    and returns that convert's source type (None if there is none)."""
    name = operand
    for _ in range(16):
        if name not in table:
            return None
        shape, op, rest = table[name]
        if op == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", rest)
            root = next((ln for ln in comps.get(callee.group(1), ()) if "ROOT" in ln), None) if callee else None
            m = _INSTR.match(root) if root else None
            if m is None:
                return None
            name = m.group(1)
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        if op == "convert" and operands and operands[0] in table:
            source = _ARRAY.findall(table[operands[0]][0])
            return source[0][0] if source else None
        if op not in _LAYOUT_OPS or not operands:
            return None
        name = operands[0]
    return None


def all_gathers(text: str) -> list[dict]:
    """Every all-gather of a compiled module: its element type, shape, the element type its
    data has before XLA:CPU's widening (``wire``), and the operand bytes per device per
    execution at that type (times the loops' trip counts, as ``collective_bytes``)."""
    comps, entry = _computations(text)
    table = _instructions(comps)
    mult = _multipliers(comps, entry)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3) not in ("all-gather", "all-gather-start"):
                continue
            operand = re.findall(r"%([\w.\-]+)", m.group(4).split(")", 1)[0])[0]
            dtype, dims = _ARRAY.findall(table[operand][0])[0]
            wire = dtype
            if dtype in ("f32", "f16"):
                narrow = _wire_dtype(operand, table, comps)
                wire = narrow if narrow and _BYTES[narrow] < _BYTES[dtype] else dtype
            count = math.prod(int(d) for d in dims.split(",") if d)
            out.append({"dtype": dtype, "wire": wire, "shape": m.group(2).split("{")[0],
                        "bytes": _BYTES[wire] * count * mult.get(comp, 0)})
    return out


def trip_counts(text: str) -> list[int]:
    """The known trip counts of the module's while loops (for the table's notes)."""
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]


if __name__ == "__main__":  # python bench/hlo_collectives.py < module.txt
    import sys

    print(json.dumps(collective_bytes(sys.stdin.read())))
