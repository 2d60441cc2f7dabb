"""GEMMs: the quantized ``dot_general`` (fprop, dgrad, wgrad), its operands and backends.

Builds on ``lp_jax.numerics`` and ``lp_jax.recipes``; knows nothing of models. A backend
(reference, XLA FP8, cuDNN block-scaled, ...) is one module here, tested against the
reference backend (docs/backends.md).
"""
