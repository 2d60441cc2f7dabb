"""The GEMMs in a program's text: lowered StableHLO (any machine) and compiled GPU HLO.

``lowered_gemms`` reads ``jax.jit(f).trace(...).lower(lowering_platforms=(...)).as_text()``
and lists every ``dot_general`` and ``__op$block_scaled_dot`` custom call with its operand
element types, once per place it appears in the program: a private function (JAX lowers
each jitted helper, ``jax.nn.scaled_matmul`` included, to one and calls it) counts once
per call site. A loop body counts once, whatever its trip count.

``compiled_gemms`` counts the GEMM library calls and fusions in an optimized GPU module
(``.lower().compile().as_text()``), to tell cuBLASLt FP8 GEMMs, cuDNN's block-scaled GEMM
and XLA's expansion of a block-scaled dot (plain GEMMs) apart.
"""
from __future__ import annotations

import collections
import re

from lp_jax.kernels import fp8_block_gemm

_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w$.\-]+)\(")
_CALL = re.compile(r"\bcall @([\w$.\-]+)\(")
_SIGNATURE = re.compile(r":\s*\(([^()]*)\)\s*->")
_ELEMENT = re.compile(r"tensor<(?:[\d?]+x)*([^>,\s]+)>")
BLOCK_SCALED_DOT = "__op$block_scaled_dot"


def _operand_types(line: str) -> tuple[str, ...]:
    m = _SIGNATURE.search(line)
    return tuple(_ELEMENT.findall(m.group(1))) if m else ()


def lowered_gemms(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """[(kind, operand element types)] with kind "dot_general" or "block_scaled_dot"."""
    funcs: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name is not None:
            funcs[name].append(line)

    def expand(fn, seen=()):
        out = []
        for line in funcs.get(fn, ()):
            if "stablehlo.dot_general" in line:
                out.append(("dot_general", _operand_types(line)))
            elif f"@{BLOCK_SCALED_DOT}" in line:
                out.append(("block_scaled_dot", _operand_types(line)))
            for callee in _CALL.findall(line):
                if callee in funcs and callee not in seen:
                    out.extend(expand(callee, seen + (fn,)))
        return out

    return expand("main")


def fp8_dots(gemms) -> list[tuple[str, ...]]:
    """The dot_generals whose two operands are both FP8."""
    return [t for kind, t in gemms if kind == "dot_general" and len(t) >= 2
            and all(x.startswith("f8") for x in t[:2])]


def block_scaled_dots(gemms) -> list[tuple[str, ...]]:
    """Operand types (lhs, rhs, lhs scales, rhs scales) of each block-scaled dot."""
    return [t for kind, t in gemms if kind == "block_scaled_dot"]


# Compiled GPU HLO: custom-call targets and fusion kinds that run a GEMM.
GPU_GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__cublas$lt$matmul", "__cublas$gemm",
                    "__cudnn$blockScaledDot", BLOCK_SCALED_DOT)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__cudnn\$fusion|__triton_gemm|__triton_nested_gemm_fusion|'
                          r'__triton_scaled_dot_fusion|__cublas[^"]*)"')


def compiled_gemms(text: str) -> dict[str, int]:
    """Counts of GEMM custom calls by target and of GEMM fusions by kind (static)."""
    counts = collections.Counter()
    for line in text.splitlines():
        for target in _TARGET.findall(line):
            if target in GPU_GEMM_TARGETS:
                counts[target] += 1
            elif fp8_block_gemm.called_by(line):
                counts["lp_jax wgmma FP8 block GEMM"] += 1
        for kind in _FUSION_KIND.findall(line):
            counts[f"fusion {kind}"] += 1
    return dict(counts)
