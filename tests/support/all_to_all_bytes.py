"""The operand bytes of a program's all-to-alls, by element type: in the lowered program (the
dtypes JAX asks XLA to move) and in the compiled one (what XLA moves: XLA:CPU moves BF16
all-to-alls in FP32)."""
from __future__ import annotations

import collections
import math

from jax.interpreters.mlir import ir

from lp_jax.plan.hlo_module import DTYPE_BYTES, Module, arrays


def lowered_all_to_all_bytes(lowered) -> dict[str, int]:
    """Operand bytes of the all-to-alls of a lowered program (StableHLO, the dtypes JAX asks
    XLA to move), by element type, read off the MLIR module's operations."""
    by_type = collections.Counter()

    def visit(op):
        if op.name == "stablehlo.all_to_all":
            for value in op.operands:
                t = ir.RankedTensorType(value.type)
                by_type[str(t.element_type)] += math.prod(t.shape) * t.element_type.width // 8
        return ir.WalkResult.ADVANCE

    module = lowered.compiler_ir("stablehlo")
    with module.context:
        module.operation.walk(visit)
    return dict(by_type)


def compiled_all_to_all_bytes(hlo_text: str) -> dict[str, int]:
    """Operand bytes of the all-to-alls of a compiled HLO module (``compiled.as_text()``), by
    element type, times the runs of their computation, parsed by lp_jax.plan's reader."""
    module = Module.parse(hlo_text)
    by_type = collections.Counter()
    for name, runs in module.runs().items():
        for instr in module.computations[name].instructions:
            if instr.opcode.removesuffix("-start") != "all-to-all":
                continue
            for operand in instr.operands:
                for dtype, dims in arrays(module.operand_shape(operand)):
                    by_type[dtype] += int(DTYPE_BYTES[dtype] * math.prod(dims)) * runs
    return dict(by_type)
