"""A compiled HLO module's text, parsed: computations, instructions, shapes and how often
each computation runs.

Read from ``compiled.as_text()`` (XLA's optimized module after buffer assignment): an
instruction is ``%name = SHAPE opcode(%operand, ...), attributes``; its operands are named,
so their shapes come from the module-wide table of instruction and parameter shapes. A
computation runs once per call from the entry computation, ``n`` times as the body of a
``while`` whose backend config states ``known_trip_count`` n (nested loops multiply); each
branch of a ``conditional`` once, unless the conditional names the branch expected to run
(``EXPECTED_BRANCH``).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f8e4m3": 1, "f4e2m1fn": 0.5, "c64": 8}
# An array type with its layout: bf16[8,128]{1,0}; a 4-bit type packs two to a byte.
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEAD = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->\s*(.*?)\s*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_NAME = re.compile(r"%([\w.\-]+)")


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dims) of each array in an HLO shape (an array or a tuple of them)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape) if dtype in DTYPE_BYTES]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (arrays, or a tuple of them); 4-bit types are packed."""
    return int(sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(shape)))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]  # instruction or parameter names
    attrs: str  # everything after the operand list
    root: bool = False

    @property
    def custom_call_target(self) -> str:
        """A custom call's target (quoted in the text), or "" for any other instruction."""
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return m.group(1) if m else ""

    def attr(self, key: str) -> str | None:
        """The value of ``key=...`` (a %name, a {...} group or a bare word), or None."""
        m = re.search(rf"\b{re.escape(key)}=(%?[\w.\-$]+|\{{[^}}]*\}})", self.attrs)
        return m.group(1).lstrip("%") if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]
    params: dict[str, str]  # parameter name -> shape

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.root), self.instructions[-1])


def _split_top(text: str, start: int) -> int:
    """The index of the parenthesis closing the one opened at ``text[start - 1]``."""
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    depth, i = 0, 0
    while i < len(rest):  # the opcode is the first name( at bracket depth 0 after the shape
        c = rest[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and (i == 0 or rest[i - 1] == " "):
            op = _OPCODE.match(rest, i)
            if op:
                close = _split_top(rest, op.end())
                return Instruction(m.group(2), rest[:i].strip(), op.group(1),
                                   tuple(_NAME.findall(rest[op.end():close])),
                                   rest[close + 1:].lstrip(", "), bool(m.group(1)))
        i += 1
    return None


def _params(signature: str) -> dict[str, str]:
    """{name: shape} of a computation's parameter list ``a: f32[2], b: (s32[], bf16[4])``."""
    out, names = {}, list(_PARAM.finditer(signature))
    for k, m in enumerate(names):
        if m.start() and signature[m.start() - 1] not in " (,":
            continue
        end = names[k + 1].start() if k + 1 < len(names) else len(signature)
        out[m.group(1)] = signature[m.end():end].rstrip(", ")
    return out


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    shapes: dict[str, str]  # every instruction's and parameter's shape, by name

    @classmethod
    def parse(cls, text: str) -> "Module":
        comps, entry, current = {}, None, None
        for line in text.splitlines():
            m = _COMP.match(line)
            if m:
                current = Computation(m.group(2), [], _params(m.group(3)))
                comps[current.name] = current
                if m.group(1):
                    entry = current.name
            elif line.strip() == "}":
                current = None
            elif current is not None:
                instr = parse_instruction(line)
                if instr is not None:
                    current.instructions.append(instr)
        if entry is None:
            raise ValueError("not an HLO module: no ENTRY computation")
        shapes = {}
        for comp in comps.values():
            shapes.update(comp.params)
            shapes.update((i.name, i.shape) for i in comp.instructions)
        return cls(comps, entry, shapes)

    def operand_shape(self, name: str) -> str:
        return self.shapes.get(name, "")

    def runs(self) -> dict[str, int]:
        """How many times each executed computation runs per run of the entry computation
        (fused computations and reducers are parts of their kernel, not listed)."""
        mult = collections.Counter({self.entry: 1})
        order = [self.entry]
        for name in order:
            for instr in self.computations[name].instructions:
                for callee, n in _callees(instr):
                    if callee in self.computations:
                        mult[callee] += mult[name] * n
                        if callee not in order:
                            order.append(callee)
        return dict(mult)

    def looped(self) -> set[str]:
        """The executed computations that run inside a ``while`` (its body or condition, and
        what those call)."""
        inside: set[str] = set()
        order = [(self.entry, False)]
        seen = set()
        while order:
            name, in_loop = order.pop()
            if (name, in_loop) in seen or name not in self.computations:
                continue
            seen.add((name, in_loop))
            if in_loop:
                inside.add(name)
            for instr in self.computations[name].instructions:
                for callee, _ in _callees(instr):
                    order.append((callee, in_loop or instr.opcode == "while"))
        return inside

    def trip_counts(self) -> list[int]:
        """The known trip count of every while loop (1 where XLA states none)."""
        return [n for comp in self.computations.values() for i in comp.instructions
                if i.opcode == "while" for _, n in _callees(i)[:1]]


def trip_count(instr: Instruction) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else 1


def _callees(instr: Instruction) -> list[tuple[str, int]]:
    """Computations an instruction runs as code of its own (not fused into it): a while's
    body and condition, a call's target, a conditional's branches, an async op's body."""
    if instr.opcode == "while":
        n = trip_count(instr)
        return [(c, n) for c in (instr.attr("body"), instr.attr("condition")) if c]
    if instr.opcode == "call":
        target = instr.attr("to_apply")
        return [(target, 1)] if target else []
    if instr.opcode == "conditional":
        branches = _NAME.findall(instr.attr("branch_computations") or "")
        expected = EXPECTED_BRANCH.search(instr.attrs)
        if expected and int(expected.group(1)) < len(branches):
            return [(branches[int(expected.group(1))], 1)]
        return [(b, 1) for b in branches]  # which one runs is data: each counts (a bound)
    return []


# A conditional traced under ``jax.named_scope(f"lp_expected_branch_{i}")`` counts only its
# branch i: the one its caller expects to run (lp.ragged_dot names the window a group of an
# even share of the rows takes, so the plan costs expert GEMMs under balanced routing).
EXPECTED_BRANCH = re.compile(r'op_name="[^"]*\blp_expected_branch_(\d+)')
