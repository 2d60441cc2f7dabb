"""lp_jax: low-precision (BF16, FP8-CS, MXFP8, NVFP4) training for Flax NNX models.

Quantizers: quantize, dequantize, hadamard, QuantizedTensor.
Training GEMMs: get_recipe (and the recipe classes), dot_general, ragged_dot (grouped, for
experts), apply_recipe (NNX),
apply_recipe_linen and linen_report (Linen).

The names load on first use (``lp_jax.lazy_exports``), so importing a submodule does not start
JAX; docs/architecture.md draws the stack below them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lp_jax.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "lp_jax.gemm.dot_general": ("KeepKernelDtype", "LowPrecisionDotGeneral", "dot_general"),
    "lp_jax.gemm.ragged_dot": ("LowPrecisionRaggedDot", "ragged_dot"),
    "lp_jax.numerics.hadamard": ("hadamard",),
    "lp_jax.numerics.quantize": ("FORMATS", "QuantizedTensor", "dequantize"),
    "lp_jax.quantizer": ("quantize",),
    "lp_jax.recipes": ("BF16", "RECIPES", "Float8BlockScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                       "NVFP4BlockScaling", "OperandSpec", "Recipe", "get_recipe"),
    "lp_jax.surgery.linen": ("apply_recipe_linen", "linen_report"),
    "lp_jax.surgery.swap": ("SwapReport", "apply_recipe"),
}, globals())

if TYPE_CHECKING:
    from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral, dot_general
    from lp_jax.gemm.ragged_dot import LowPrecisionRaggedDot, ragged_dot
    from lp_jax.numerics.hadamard import hadamard
    from lp_jax.numerics.quantize import FORMATS, QuantizedTensor, dequantize
    from lp_jax.quantizer import quantize
    from lp_jax.recipes import (
        BF16,
        RECIPES,
        Float8BlockScaling,
        Float8CurrentScaling,
        MXFP8BlockScaling,
        NVFP4BlockScaling,
        OperandSpec,
        Recipe,
        get_recipe,
    )
    from lp_jax.surgery.linen import apply_recipe_linen, linen_report
    from lp_jax.surgery.swap import SwapReport, apply_recipe
