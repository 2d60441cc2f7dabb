"""The kernels a compiled GPU module launches, each with its HBM bytes, FLOPs and, for a
GEMM, the library that runs it and its operand type.

A kernel is an instruction of an executed computation (the entry, loop bodies, called
computations) other than the bookkeeping ones (parameters, tuples, bitcasts, the second half
of an async pair), counted as often as its computation runs. Its bytes are its operands'
and its result's, except where it reads or writes a slice of a buffer in place (a
``dynamic-slice`` or ``dynamic-update-slice``, alone or as its fusion's root or parameter
use): then the slice counts, not the buffer. FLOPs are the GEMMs' (2 per multiply-add) and
attention's; elementwise work is left to the bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

from lp_jax.kernels import fp8_block_gemm
from lp_jax.plan.hlo_module import Instruction, Module, arrays, shape_bytes

# Instructions that launch nothing: plumbing, aliases, loop control and async halves.
NOT_KERNELS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "add-dependency", "opt-barrier",
    "domain", "get-dimension-size", "copy-done", "all-gather-done", "all-reduce-done",
    "all-to-all-done", "collective-permute-done", "async-done", "async-update", "send-done", "recv-done",
    "fusion-done",
})
# A fusion XLA runs asynchronously (a dynamic-update-slice into a loop buffer, overlapped with
# the next kernels) is a fusion-start / fusion-done pair: the start is the kernel.
FUSIONS = ("fusion", "fusion-start")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
GEMM_LIBRARIES = ("cudnn_block_scaled", "pallas_wgmma", "cublaslt_fp8", "cublas", "triton", "cudnn_fusion",
                  "cudnn_attention", "xla")
_CUSTOM_GEMMS = {"__cudnn$blockScaledDot": "cudnn_block_scaled", "__cublas$lt$matmul$f8": "cublaslt_fp8",
                 "__cublas$lt$matmul": "cublas", "__cublas$gemm": "cublas"}
_OPERAND_TYPES = {"f8e4m3fn": "fp8", "f8e5m2": "fp8", "f4e2m1fn": "fp4", "bf16": "bf16", "f16": "bf16",
                  "f32": "fp32"}
# FlashAttention's backward: five GEMMs of the forward's shape to its two.
ATTENTION_BACKWARD_FACTOR = 2.5


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    opcode: str
    runs: int  # launches per step
    bytes: int  # HBM bytes per launch
    flops: float = 0.0  # per launch
    library: str | None = None  # for GEMMs and attention: one of GEMM_LIBRARIES
    operand_type: str | None = None  # "bf16" | "fp8" | "fp4" | "fp32": which peak applies
    collective: str | None = None  # one of COLLECTIVES
    group_size: int = 1  # devices in the collective's groups
    is_async: bool = False  # a collective the scheduler may overlap with compute
    looped: bool = False  # its computation runs inside a while loop (a layer scan)


def kernels(module: Module, device_count: int = 1) -> list[Kernel]:
    """Every kernel launch of one run of the module, grouped by instruction."""
    out, looped = [], module.looped()
    for comp_name, runs in module.runs().items():
        for instr in module.computations[comp_name].instructions:
            if instr.opcode in NOT_KERNELS:
                continue
            k = _kernel(module, instr, runs, device_count)
            out.append(dataclasses.replace(k, looped=True) if comp_name in looped else k)
    return out


def _kernel(module: Module, instr: Instruction, runs: int, device_count: int) -> Kernel:
    collective = _collective_kind(module, instr)
    if collective is not None:
        operand_bytes = sum(shape_bytes(module.operand_shape(o)) for o in instr.operands)
        return Kernel(instr.name, instr.opcode, runs, operand_bytes, collective=collective,
                      group_size=_group_size(instr, device_count),
                      is_async=instr.opcode.endswith("-start") or instr.opcode == "async-start")
    library, operand_type, flops = _gemm(module, instr)
    return Kernel(instr.name, instr.opcode, runs, _bytes(module, instr), flops, library, operand_type)


def _collective_kind(module: Module, instr: Instruction) -> str | None:
    op = instr.opcode.removesuffix("-start")
    if op in COLLECTIVES:
        return op
    if instr.opcode == "async-start":  # async-start(calls=%reduce-scatter wrapper)
        called = module.computations.get(instr.attr("calls") or "")
        if called is not None and called.root.opcode in COLLECTIVES:
            return called.root.opcode
    return None


def _group_size(instr: Instruction, device_count: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", instr.attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", instr.attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"source_target_pairs=", instr.attrs)
    return 2 if m else device_count


# ----------------------------------------------------------------------------- bytes


def _users(comp, name: str) -> list[Instruction]:
    return [i for i in comp.instructions if name in i.operands]


# Elementwise ops of one operand, through which a fusion reads only the elements a slice takes.
_PASS_THROUGH = frozenset({"convert", "bitcast", "copy", "negate", "abs"})


def _sliced_elements(comp, name: str) -> int | None:
    """Elements of ``name`` a fusion reads when every use is a (dynamic) slice, possibly
    through single-operand elementwise ops; None when some use reads all of it."""
    users = _users(comp, name)
    if not users:
        return None
    total = 0
    for u in users:
        if u.opcode in ("slice", "dynamic-slice") and u.operands[0] == name:
            total += math.prod(_dims(u.shape))
        elif u.opcode in _PASS_THROUGH and len(u.operands) == 1:
            inner = _sliced_elements(comp, u.name)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def _updated_in_place(comp, name: str) -> int | None:
    """Elements of ``name`` a fusion reads when it updates ``name`` in place, else None.

    In place: every use of ``name`` is the buffer a dynamic-update-slice writes into,
    directly or through bitcasts (a bitcast moves no bytes: XLA bitcasts a stacked buffer
    whose layout puts the layer axis inside, and still updates it in place), or a
    dynamic-slice of it at an update's start indices (XLA's GPU emitter updates in place
    then too, reading only that slice first: a read-modify-write of a window)."""
    users = _users(comp, name)
    starts = {tuple(u.operands[2:]) for u in users
              if u.opcode == "dynamic-update-slice" and u.operands[0] == name}
    read, updated = 0, bool(starts)
    for u in users:
        if u.opcode == "bitcast":
            inner = _updated_in_place(comp, u.name)
            if inner is None:
                return None
            read, updated = read + inner, True
        elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
            continue
        elif u.opcode == "dynamic-slice" and u.operands[0] == name and tuple(u.operands[1:]) in starts:
            read += math.prod(_dims(u.shape))
        else:
            return None
    return read if updated else None


def _param_read_bytes(comp, param: Instruction) -> int:
    """What a fused parameter reads: the slices taken of it when every use is a slice (or an
    elementwise op of one whose every use is), nothing when every use is the buffer a
    dynamic-update-slice writes into (or only the slice it reads there first)."""
    full = math.prod(_dims(param.shape)) or 1
    in_place = _updated_in_place(comp, param.name)
    if in_place is not None:
        return shape_bytes(param.shape) * in_place // full
    sliced = _sliced_elements(comp, param.name)
    if sliced is not None:
        return min(shape_bytes(param.shape), shape_bytes(param.shape) * sliced // full)
    return shape_bytes(param.shape)


def _written_bytes(module: Module, comp, instr: Instruction) -> int:
    """What an instruction writes: the update of a dynamic-update-slice, else its result."""
    if instr.opcode == "dynamic-update-slice":
        return shape_bytes(module.operand_shape(instr.operands[1]))
    if instr.opcode == "tuple" and comp is not None:
        by_name = {i.name: i for i in comp.instructions}
        return sum(_written_bytes(module, comp, by_name[o]) if o in by_name else
                   shape_bytes(module.operand_shape(o)) for o in instr.operands)
    return shape_bytes(instr.shape)


def _bytes(module: Module, instr: Instruction) -> int:
    if instr.opcode == "dynamic-update-slice":
        update = shape_bytes(module.operand_shape(instr.operands[1]))
        return 2 * update + sum(shape_bytes(module.operand_shape(o)) for o in instr.operands[2:])
    if instr.opcode == "dynamic-slice":
        return 2 * shape_bytes(instr.shape)
    fused = module.computations.get(instr.attr("calls") or "") if instr.opcode in FUSIONS else None
    if fused is None:
        return shape_bytes(instr.shape) + sum(shape_bytes(module.operand_shape(o)) for o in instr.operands)
    read = sum(_param_read_bytes(fused, p) for p in fused.instructions if p.opcode == "parameter")
    return read + _written_bytes(module, fused, fused.root)



# ----------------------------------------------------------------------------- GEMMs


def _dims(shape: str) -> tuple[int, ...]:
    found = arrays(shape)
    return found[0][1] if found else ()


def _element(shape: str) -> str | None:
    found = arrays(shape)
    return found[0][0] if found else None


def _int_list(text: str | None) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


def _dot_flops(module: Module, instr: Instruction) -> float:
    lhs = _dims(module.operand_shape(instr.operands[0]))
    contracting = _int_list(instr.attr("lhs_contracting_dims"))
    k = math.prod(lhs[d] for d in contracting if d < len(lhs))
    return 2.0 * math.prod(_dims(instr.shape)) * k


def _fused(module: Module, comp_name: str, opcodes, seen=None) -> list[Instruction]:
    """Instructions of these opcodes in a fused computation and the fusions it calls."""
    seen = set() if seen is None else seen
    comp = module.computations.get(comp_name)
    if comp is None or comp_name in seen:
        return []
    seen.add(comp_name)
    found = [i for i in comp.instructions if i.opcode in opcodes]
    for i in comp.instructions:
        if i.opcode == "fusion" and i.attr("calls"):
            found += _fused(module, i.attr("calls"), opcodes, seen)
    return found


def _wgmma_flops(module: Module, instr: Instruction) -> float:
    """lp_jax's Hopper FP8 block GEMM: a [M, K] (E4M3), its scales, b [N, K], its scales ->
    out [M, N] (FP32)."""
    out, lhs = _dims(instr.shape), _dims(module.operand_shape(instr.operands[0]))
    return 2.0 * math.prod(out) * (lhs[-1] if lhs else 0)


def _backend_config(instr: Instruction) -> dict:
    m = re.search(r"backend_config=(\{.*\})\s*$", instr.attrs)
    if not m:
        return {}
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return {}


def _gemm(module: Module, instr: Instruction) -> tuple[str | None, str | None, float]:
    """(library, operand type, FLOPs) of a GEMM or attention kernel, else (None, None, 0)."""
    if instr.opcode == "custom-call":
        target = instr.custom_call_target
        operand_type = _OPERAND_TYPES.get(_element(module.operand_shape(instr.operands[0])) if instr.operands else "")
        if target in _CUSTOM_GEMMS:
            return _CUSTOM_GEMMS[target], operand_type, _custom_gemm_flops(module, instr, target)
        if target.startswith("__cudnn$fmha"):
            return "cudnn_attention", operand_type, _attention_flops(module, instr, target)
        if fp8_block_gemm.called_by(instr.attrs):
            return "pallas_wgmma", "fp8", _wgmma_flops(module, instr)
        return None, None, 0.0
    if instr.opcode == "dot":
        return "xla", _OPERAND_TYPES.get(_element(module.operand_shape(instr.operands[0]))), _dot_flops(module, instr)
    if instr.opcode == "fusion" and instr.attr("calls"):
        # A custom call XLA wrapped in a fusion (a dynamic-slice fusion around a kernel that
        # reads one layer of a scanned stack)
        kernels = [i for i in _fused(module, instr.attr("calls"), ("custom-call",))
                   if fp8_block_gemm.called_by(i.attrs)]
        if kernels:
            return "pallas_wgmma", "fp8", sum(_wgmma_flops(module, i) for i in kernels)
        dots = _fused(module, instr.attr("calls"), ("dot", "scaled-dot"))
        if not dots:
            return None, None, 0.0
        kind = _backend_config(instr).get("fusion_backend_config", {}).get("kind", "")
        library = "triton" if "triton" in kind else "cudnn_fusion" if "cudnn" in kind else "xla"
        operand_type = _OPERAND_TYPES.get(_element(module.operand_shape(dots[0].operands[0])))
        return library, operand_type, sum(_dot_flops(module, d) for d in dots)
    return None, None, 0.0


def _custom_gemm_flops(module: Module, instr: Instruction, target: str) -> float:
    out = _dims(instr.shape)  # the result is the first array (a workspace may follow)
    lhs = _dims(module.operand_shape(instr.operands[0]))
    if target == "__cudnn$blockScaledDot":  # lhs [B, M, K], rhs [B, N, K], out [B, M, N]
        return 2.0 * math.prod(out) * (lhs[-1] if lhs else 0)
    dims = _backend_config(instr).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    k = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []) if int(d) < len(lhs))
    return 2.0 * math.prod(out) * k


def _attention_flops(module: Module, instr: Instruction, target: str) -> float:
    """4 B H T S D for the forward (QK^T and PV over the full square), times
    ATTENTION_BACKWARD_FACTOR for the backward; q is [B, T, H, D], k [B, S, H_kv, D]."""
    q = _dims(module.operand_shape(instr.operands[0]))
    k = _dims(module.operand_shape(instr.operands[1])) if len(instr.operands) > 1 else q
    if len(q) != 4 or len(k) != 4:
        return 0.0
    b, t, h, d = q
    forward = 4.0 * b * h * t * k[1] * d
    return forward * (ATTENTION_BACKWARD_FACTOR if "Backward" in target else 1.0)
