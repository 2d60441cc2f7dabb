"""FP32-accumulated weight gradients for the Linears a precision recipe never touches.

``apply_recipe`` leaves the LM head on ``lax.dot_general`` (it is never quantized). A BF16
``nnx.Linear`` there computes its weight gradient as a BF16 dot, so when the tokens are
split over devices (data or FSDP parallelism) the partial gradients are summed across
devices in BF16: measured on the tiny model over 8 CPU devices, LM-head gradient elements
up to 6% (of the largest) off the one-device values, which moved the clipped global norm
by 6e-4 and every loss after the first update by ~2e-5. The trainer gives those Linears
lp_jax's BF16 GEMM instead: the same BF16 operands and FP32 accumulation in the forward
(the same logits), and the weight gradient accumulated and returned in FP32, as for every
transformer Linear, so any cross-device sum is an FP32 sum.
"""
from __future__ import annotations

import jax
from flax import nnx

from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.recipes import BF16


def fp32_weight_gradients(model) -> list[str]:
    """Swaps lp_jax's BF16 GEMM into every nnx.Linear still on lax.dot_general (in place);
    returns their paths. Call it after each apply_recipe (which resets them)."""
    swapped = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and node.dot_general is jax.lax.dot_general:
            node.dot_general = LowPrecisionDotGeneral(BF16())
            node.promote_dtype = KeepKernelDtype()
            swapped.append("/".join(map(str, path)))
    return swapped
