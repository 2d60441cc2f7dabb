"""Collective bytes per device in a compiled (SPMD-partitioned) HLO module's text.

Each all-gather / reduce-scatter / all-reduce / all-to-all / collective-permute counts the
bytes of its operands (what one device sends into it), times how often it runs: once in
the entry computation, ``n`` times inside a while loop with ``known_trip_count`` n (the
layer scan and the micro-batch scan nest, so their counts multiply). Async pairs count
their ``-start`` half once.

``collectives`` lists each collective with its device groups, and ``mesh_axes`` names the
mesh axes a group spans, so bytes can be split by axis (``bytes_by_axes``): the data-axis
gradient reduction of a train step, say, apart from FSDP's and tensor parallelism's.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
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


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module."""

    kind: str  # one of KINDS
    bytes: int  # operand bytes one device feeds in, per execution
    runs: int  # executions per run of the module (loop trip counts multiplied)
    in_loop: bool  # inside a while loop (a scan over micro-batches or layers)
    groups: tuple[tuple[int, ...], ...] | None  # device groups; None: all devices
    reducer: str | None  # "add", "maximum", ... for reductions
    # ``bytes`` if the operand were sent in the narrower float type it was rounded to just
    # before: XLA:CPU widens BF16 collectives to F32 (convert(convert(x)) feeding them);
    # GPU compilers keep them BF16.
    narrow_bytes: int = 0
    dtype: str = ""  # the element type of its (first) operand in the compiled module


def _iota_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """[G,S]<=[d0,d1,...]T(p...): iota over dims, transposed by p, reshaped to G x S."""
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    g, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    ids = list(range(math.prod(dims)))
    if m.group(4):
        perm = [int(p) for p in m.group(4).split(",")]
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
        ids = [sum(idx[k] * strides[perm[k]] for k in range(len(dims)))
               for idx in itertools.product(*(range(dims[p]) for p in perm))]
    return tuple(tuple(ids[i * size:(i + 1) * size]) for i in range(g))


def _mesh_groups(sizes: dict[str, int], axes) -> tuple[tuple[int, ...], ...]:
    """Device groups spanning mesh ``axes`` (row-major device order, as make_mesh lays them)."""
    names = list(sizes)
    groups = collections.defaultdict(list)
    for idx in itertools.product(*(range(sizes[n]) for n in names)):
        flat = sum(i * math.prod(sizes[n] for n in names[k + 1:]) for k, i in enumerate(idx))
        key = tuple(i for n, i in zip(names, idx) if n not in axes)
        groups[key].append(flat)
    return tuple(tuple(g) for g in groups.values())


def replica_groups(attrs: str):
    """The device groups of a collective's attribute text; None for all devices."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return _mesh_groups(sizes, re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=(\[\d+,\d+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        return _iota_groups(m.group(1))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return tuple(tuple(int(v) for v in g.split(",") if v)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    return None


def mesh_axes(groups, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of a mesh of ``sizes``, e.g. {"data": 2, "fsdp": 2, "tensor": 2}) whose
    devices ``groups`` connect; ("?",) if no set of axes gives exactly these groups."""
    if groups is None:
        return tuple(n for n in sizes if sizes[n] > 1)
    wanted = sorted(tuple(sorted(g)) for g in groups)
    names = [n for n in sizes if sizes[n] > 1]
    for r in range(len(names) + 1):
        for axes in itertools.combinations(names, r):
            if sorted(tuple(sorted(g)) for g in _mesh_groups(sizes, axes)) == wanted:
                return axes
    return ("?",)


def collectives(text: str) -> list[Collective]:
    """Every collective of a compiled module's text (see Collective)."""
    comps, entry = _computations(text)
    shapes = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
    mult, looped = _multipliers(comps, entry), _looped(comps, entry)
    out = []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3).removesuffix("-start")
            if op not in KINDS or m.group(3).endswith("-done"):
                continue
            args, attrs = (m.group(4).split(")", 1) + [""])[:2]
            operands = re.findall(r"%([\w.\-]+)", args)
            size = shape_bytes(args) or sum(shape_bytes(shapes.get(o, "")) for o in operands)
            # XLA:CPU splits a widened all-to-all into one operand per peer: all must be narrow.
            widths = {_rounded_width(comps, lines, o) for o in operands} if operands else {None}
            narrow = widths.pop() if len(widths) == 1 else None
            types = _ARRAY.findall(args) or _ARRAY.findall(shapes.get(operands[0], "") if operands else "")
            out.append(Collective(op, size, mult.get(name, 0), name in looped,
                                  replica_groups(attrs), _reducer(comps, attrs),
                                  size * narrow // 4 if narrow and "f32[" in args + shapes.get(operands[0], "")
                                  else size, types[0][0] if types else ""))
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


def _rounded_width(comps, lines, operand: str) -> int | None:
    """Bytes per element of the type an F32 operand was just rounded to (a fusion whose
    root is convert(convert(x)) through bf16/f16, or convert of a bf16/f16 value reached
    through layout ops and slices: XLA:CPU's widening of a BF16 all-to-all), else None."""
    for line in lines:
        m = _INSTR.match(line)
        if not m or m.group(1) != operand or m.group(3) != "fusion":
            continue
        callee = re.search(r"calls=%?([\w.\-]+)", m.group(4))
        body = comps.get(callee.group(1), []) if callee else []
        instrs = {i.group(1): i for i in map(_INSTR.match, body) if i}
        root = next((i for i in map(_INSTR.match, body) if i and "ROOT" in i.string.split("=")[0]), None)
        first = lambda i: instrs.get((re.findall(r"%([\w.\-]+)", i.group(4)) or [""])[0])  # noqa: E731
        while root is not None and root.group(3) in ("copy", "bitcast", "transpose"):
            root = first(root)  # layout changes after the widening
        if root is None or root.group(3) != "convert":
            return None
        inner = first(root)
        while inner is not None and inner.group(3) in ("copy", "bitcast", "transpose", "slice", "reshape"):
            inner = first(inner)
        if inner is not None and inner.group(3) in ("convert", "parameter"):
            for dtype, width in (("bf16[", 2), ("f16[", 2)):
                if inner.group(2).startswith(dtype):
                    return width
    return None


def _reducer(comps, attrs: str) -> str | None:
    m = re.search(r"to_apply=%?([\w.\-]+)", attrs)
    if not m:
        return None
    for line in comps.get(m.group(1), ()):
        op = _INSTR.match(line)
        if op and op.group(3) not in ("parameter", "constant", "tuple", "get-tuple-element"):
            return op.group(3)
    return None


def _looped(comps, entry) -> set[str]:
    """Computations that run inside a while loop (directly or through calls)."""
    inside, order = set(), [(entry, False)]
    seen = set()
    while order:
        name, in_loop = order.pop()
        if (name, in_loop) in seen:
            continue
        seen.add((name, in_loop))
        if in_loop:
            inside.add(name)
        for line in comps.get(name, ()):
            m = _INSTR.match(line)
            if not m:
                continue
            loop = in_loop or m.group(3) == "while"
            for callee in re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)",
                                     m.group(4)):
                if callee in comps:
                    order.append((callee, loop))
    return inside


def collective_bytes(text: str) -> dict[str, int]:
    """{kind: operand bytes per device per execution} for the KINDS, from HLO text."""
    out = dict.fromkeys(KINDS, 0)
    for c in collectives(text):
        out[c.kind] += c.bytes * c.runs
    return out


def bytes_by_axes(text: str, sizes: dict[str, int]) -> dict[tuple[str, tuple[str, ...]], int]:
    """{(kind, mesh axes): operand bytes per device per run of the module}."""
    out = collections.Counter()
    for c in collectives(text):
        out[(c.kind, mesh_axes(c.groups, sizes))] += c.bytes * c.runs
    return dict(out)


def trip_counts(text: str) -> list[int]:
    """The known trip counts of the module's while loops (for the table's notes)."""
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]


if __name__ == "__main__":  # python bench/hlo_collectives.py < module.txt
    import sys

    print(json.dumps(collective_bytes(sys.stdin.read())))
