"""Numerics: the element formats, one object per quantized format (``registry``), the
quantizers and the Hadamard transform (docs/numerics.md).

Pure jnp on arrays, no Flax and no GEMMs. These functions define every rounding: the NumPy
oracle checks them bit for bit, and a GPU kernel that quantizes (Pallas) must match them.
"""
