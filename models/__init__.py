"""Plain Flax NNX models (no quantization code): precision is applied by lp_jax.apply_recipe."""
