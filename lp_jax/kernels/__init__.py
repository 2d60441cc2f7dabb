"""Pallas (Mosaic GPU) kernels for the quantizers: ``lp.quantize(..., impl="pallas")``.

They give the XLA path's bits (each kernel applies lp_jax.numerics.quantize's block
functions to its tiles) in fewer passes over memory: the amax, then one pass that writes
every copy of the tensor a GEMM needs. On CPU they run in Pallas's GPU interpreter
(docs/backends.md, "Pallas quantization kernels").
"""
from lp_jax.kernels.select import IMPLS, check_impl, resolve  # noqa: F401
