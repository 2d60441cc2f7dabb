"""Numerics: the element formats, the quantizers and the Hadamard transform (docs/numerics.md).

Pure jnp on arrays, no Flax and no GEMMs: everything above (the GEMM backends, the
training loop) builds on these definitions, and the NumPy oracle in tests/ checks them bit
for bit. A GPU kernel that quantizes (Pallas) belongs beside them and must match them.
"""
