"""``python -m lp_jax.inspect RUN_DIR``: which layers to keep in BF16 (``lp_jax.inspect.cli``,
docs/telemetry.md)."""
