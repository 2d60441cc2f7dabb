"""Pallas (Mosaic GPU) kernels for the quantizers, behind ``lp.quantize(..., impl="pallas")``.

Each kernel applies ``lp_jax.numerics.quantize``'s block functions to its tiles, so it gives
the XLA path's bits in fewer passes over memory: the amax, then one pass that writes every
copy of the tensor a GEMM needs. On CPU they run in Pallas's GPU interpreter.
"""
