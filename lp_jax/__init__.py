"""lp_jax: low-precision (BF16, FP8-CS, MXFP8, NVFP4) training for Flax NNX models.

Quantizers: quantize, dequantize, hadamard, QuantizedTensor.
Training GEMMs: get_recipe (and the recipe classes), dot_general, apply_recipe.
"""
from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral, dot_general
from lp_jax.numerics.hadamard import hadamard
from lp_jax.numerics.quantize import FORMATS, QuantizedTensor, dequantize
from lp_jax.quantizer import quantize
from lp_jax.recipes import (BF16, RECIPES, Float8CurrentScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling, OperandSpec, Recipe, get_recipe)
from lp_jax.surgery.swap import SwapReport, apply_recipe

__all__ = [
    "BF16", "FORMATS", "RECIPES", "Float8CurrentScaling", "KeepKernelDtype", "LowPrecisionDotGeneral",
    "MXFP8BlockScaling", "NVFP4BlockScaling", "OperandSpec", "QuantizedTensor", "Recipe",
    "SwapReport", "apply_recipe", "dequantize", "dot_general", "get_recipe", "hadamard", "quantize",
]
