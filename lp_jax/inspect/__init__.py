"""``python -m lp_jax.inspect RUN_DIR``: which layers to keep in BF16 (cli.py, docs/telemetry.md)."""
