"""lp_jax: low-precision (BF16, FP8-CS, MXFP8, NVFP4) training for Flax NNX models.

Public API (docs/design.md): quantize, dequantize, hadamard, QuantizedTensor, and, for
training, get_recipe, dot_general, apply_recipe.
"""
from lp_jax.hadamard import hadamard
from lp_jax.quantize import FORMATS, QuantizedTensor, dequantize, quantize

__all__ = ["FORMATS", "QuantizedTensor", "dequantize", "hadamard", "quantize"]
